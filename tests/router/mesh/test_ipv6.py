"""A fleet on IPv6 addresses, as a user runs it: ``kvmesh mock`` publishing its KV events on
``tcp://[::1]:...``, ``kvmesh router`` following them, ``kvmesh events tap`` reading them back.

ZMQ sockets speak IPv4 alone unless told. The engine's bind to an IPv6 address failed ("No such
device"), and a router's connect to one was taken and never made: a worker on an IPv6 address
(vLLM's own publisher, told ``tcp://*:0``, binds one on a node whose IP is IPv6, and kvmesh
advertises one from an IPv6 ``KVMESH_SELF_URL``) was followed by no event, with nothing said."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvmesh.events.endpoint import needs_ipv6
from tests.events.eventkit import free_tcp6_port, ipv6_loopback


@pytest.mark.parametrize(
    ("endpoint", "bind", "wanted"),
    [
        ("tcp://[::1]:5557", False, True),
        ("tcp://[fd00::7]:5557", True, True),
        ("tcp://[::]:5557", True, True),
        ("tcp://*:5557", True, True),  # (every interface: IPv4 and IPv6 peers both)
        ("tcp://eth0;[fd00::7]:5557", False, True),
        ("tcp://127.0.0.1:5557", False, False),
        ("tcp://localhost:5557", False, False),  # (a name resolves to ::1 first with it on)
        ("tcp://*:5557", False, False),
        ("ipc:///tmp/events", True, False),
        ("inproc://events", False, False),
    ],
)
def test_which_sockets_need_ipv6(endpoint: str, bind: bool, wanted: bool) -> None:
    assert needs_ipv6(endpoint, bind=bind) is wanted


def _spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "kvmesh", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@contextlib.contextmanager
def _running(*args: str) -> Iterator[subprocess.Popen[str]]:
    proc = _spawn(*args)
    try:
        yield proc
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.communicate(timeout=10)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _until(check: Any, proc: subprocess.Popen[str], timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode}: {proc.communicate()[1][-2000:]}")
        with contextlib.suppress(httpx.HTTPError, KeyError, IndexError, ValueError):
            found = check()
            if found:
                return found
        time.sleep(0.1)
    raise AssertionError("timed out")


@pytest.mark.skipif(not ipv6_loopback(), reason="this host has no IPv6 loopback")
def test_a_router_follows_an_engine_publishing_on_ipv6() -> None:
    http_port, events, replay, front_port = (free_tcp6_port() for _ in range(4))
    engine_url, front = f"http://[::1]:{http_port}", f"http://[::1]:{front_port}"
    mock = ("mock", "--host", "::1", "--port", str(http_port), "--speedup", "50")
    mock += ("--kv-events-endpoint", f"tcp://[::1]:{events}", "--kv-replay-endpoint", f"tcp://[::1]:{replay}")
    router = ("router", "--host", "::1", "--port", str(front_port), "--workers", engine_url)
    with _running(*mock) as engine, _running(*router) as proxy, httpx.Client(timeout=10) as http:
        info = _until(lambda: http.get(engine_url + "/kvmesh/info").json(), engine)
        assert info["kv_events_endpoints"] == [f"tcp://[::1]:{events}"]

        def worker() -> dict[str, Any]:
            [row] = http.get(front + "/kvmesh/workers").json()["workers"]
            return dict(row)

        _until(lambda: worker()["state"] == "up", proxy)
        body = {"model": "kvmesh-mock", "messages": [{"role": "user", "content": "hello " * 200}]}
        assert http.post(front + "/v1/chat/completions", json={**body, "max_tokens": 2}).status_code == 200
        # the engine's "stored" events reach the router over IPv6
        row = _until(lambda: (w := worker())["events_applied"] > 0 and w, proxy)
        assert row["events"]["state"] == "live" and row["indexed_blocks"] > 0

        # and the tap reads them from the start, through the replay socket on IPv6
        tap = _spawn(
            "events", "tap", f"tcp://[::1]:{events}", "--replay-endpoint", f"tcp://[::1]:{replay}",
            "--from-seq", "0", "--count", "1", "--timeout", "20",
        )  # fmt: skip
        out, err = tap.communicate(timeout=30)
        assert tap.returncode == 0, err
        assert out.startswith("seq=0 rank=0 stored=") and "+blocks=" in out
