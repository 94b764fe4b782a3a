"""``kvmesh mock`` as a real process, and its --middleware hook."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware.gzip import GZipMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.testclient import TestClient

from kvmesh.errors import ConfigError
from kvmesh.mock.engine import MockEngine
from kvmesh.mock.server import add_middleware, build_app

pytestmark = pytest.mark.e2e


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (all held open while choosing, so none is handed out twice)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def test_kvmesh_mock_serves_until_terminated() -> None:
    port, events = _free_ports(2)
    cmd = [
        sys.executable,
        "-m",
        "kvmesh",
        "mock",
        "--port",
        str(port),
        "--speedup",
        "50",
        "--num-blocks",
        "256",
        "--kv-events-endpoint",
        f"tcp://127.0.0.1:{events}",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=0.5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "kvmesh mock did not come up"
            time.sleep(0.05)
        info = httpx.get(f"http://127.0.0.1:{port}/kvmesh/info").json()
        assert info["kv_events_endpoints"] == [f"tcp://127.0.0.1:{events}"]
        assert info["kv_replay_endpoints"] == [None] and info["total_kv_blocks"] == 256
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.json()["usage"]["completion_tokens"] == 2
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    assert f"serving 'kvmesh-mock' on http://127.0.0.1:{port}, KV events on tcp://127.0.0.1:{events}" in err


def test_a_busy_events_port_is_a_clear_error() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        cmd = [
            sys.executable,
            "-m",
            "kvmesh",
            "mock",
            "--port",
            str(_free_port()),
            "--kv-events-endpoint",
            f"tcp://127.0.0.1:{taken}",
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert f"kvmesh mock: cannot bind KV-event socket to 'tcp://127.0.0.1:{taken}'" in done.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--block-size", "0"], "--block-size must be a positive integer, got 0"),
        (["--num-blocks", "99999999999"], "--num-blocks must be at most 4194304 (each simulated block"),
        (["--speedup", "0"], "--speedup must be a positive finite number, got 0.0"),
        (["--speedup", "inf"], "--speedup must be a positive finite number, got inf"),
        (["--speedup", "nan"], "--speedup must be a positive finite number, got nan"),
        (  # (infinity held every decode request's simulated KV hand-off for ever)
            ["--role", "decode", "--transfer-ms-per-block", "inf"],
            "--transfer-ms-per-block must be a finite number of at least 0, got inf",
        ),
        (
            ["--transfer-fixed-ms", "-1"],
            "--transfer-fixed-ms must be a finite number of at least 0, got -1.0",
        ),
        (
            ["--request-log", "/nonexistent-kvmesh-dir/requests.jsonl"],
            "--request-log '/nonexistent-kvmesh-dir/requests.jsonl' cannot be opened: No such file or directory",
        ),
    ],
)
def test_bad_flags_name_the_flag(flags: list[str], message: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvmesh", "mock", *flags],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert f"kvmesh mock: {message}" in done.stderr


async def stamp(request: Request, call_next):  # type: ignore[no-untyped-def]
    response: Response = await call_next(request)
    response.headers["x-stamped"] = "yes"
    return response


def test_middleware_is_added_like_vllms_flag() -> None:
    app = build_app(MockEngine())
    add_middleware(app, "starlette.middleware.gzip:GZipMiddleware")
    add_middleware(app, f"{__name__}.stamp")
    assert any(m.cls is GZipMiddleware for m in app.user_middleware)
    with TestClient(app) as client:
        r = client.get("/v1/models")
        assert r.status_code == 200 and r.headers["x-stamped"] == "yes"
    for spec, message in (
        ("nocolon", "must look like module:Name"),
        ("kvmesh.nope:X", "cannot be imported"),
        ("kvmesh.mock.config:DEFAULT_MODEL", "neither a middleware class nor an async function"),
    ):
        with pytest.raises(ConfigError, match=message):
            add_middleware(Starlette(), spec)


def _mock_info(
    *flags: str, env: dict[str, str] | None = None, path: str = "/kvmesh/info"
) -> tuple[int, dict[str, object]]:
    """Start ``kvmesh mock`` with ``flags``; its events port and its answer at ``path`` (its
    /kvmesh/info), then stop it."""
    port, events, replay = _free_ports(3)
    cmd = [sys.executable, "-m", "kvmesh", "mock", "--port", str(port), "--speedup", "50"]
    cmd += ["--kv-events-endpoint", f"tcp://*:{events}", "--kv-replay-endpoint", f"tcp://*:{replay}", *flags]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})}
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                answer = httpx.get(f"http://127.0.0.1:{port}{path}", timeout=0.5)
                return events, {"status": answer.status_code, **(answer.json() if answer.is_success else {})}
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "kvmesh mock did not come up"
            time.sleep(0.05)
    finally:
        proc.terminate()
        proc.communicate(timeout=10)


@pytest.mark.parametrize(
    ("flags", "env", "host"),
    [
        (("--advertise-host", "10.1.2.3"), {}, "10.1.2.3"),
        ((), {"KVMESH_ADVERTISE_HOST": "fd00::7"}, "[fd00::7]"),
        ((), {"KVMESH_SELF_URL": "http://gpu-3.local:8000"}, "gpu-3.local"),
    ],
)
def test_event_sockets_bound_to_every_interface_are_told_at_the_engines_host(
    flags: tuple[str, ...], env: dict[str, str], host: str
) -> None:
    """Bound to ``tcp://*:P``, the mock told routers the bound address (``0.0.0.0``, and ``[::]``
    once IPv6 was on), where a router on another host dials its own."""
    events, info = _mock_info(*flags, env=env)
    assert info.pop("status") == 200
    assert info["kv_events_endpoints"] == [f"tcp://{host}:{events}"]
    assert str(info["kv_replay_endpoints"][0]).startswith(f"tcp://{host}:")  # type: ignore[index]


def test_without_worker_rpcs_the_mock_is_a_plain_vllm() -> None:
    """``--no-worker-rpc``: no /kvmesh/* routes, as ``vllm serve`` without kvmesh's plugin; vLLM's
    ``/kv_event_sources`` names the publisher as bound (a router dials it at the engine's host)."""
    _, info = _mock_info("--no-worker-rpc")
    assert info["status"] == 404
    events, sources = _mock_info("--no-worker-rpc", path="/kv_event_sources")
    assert sources.pop("status") == 200
    assert list(sources) == ["0"]
    rank = sources["0"]
    assert rank["publisher"] == "zmq"  # type: ignore[index]
    # (``*`` as ZMQ reports the bind: every IPv4 interface, or every interface with IPv6 on)
    assert rank["endpoint"] in (f"tcp://0.0.0.0:{events}", f"tcp://[::]:{events}")  # type: ignore[index]
    assert str(rank["replay_endpoint"]).startswith(("tcp://0.0.0.0:", "tcp://[::]:"))  # type: ignore[index]
