"""Worker registry behaviour seen from outside: refusal, health, re-admission, busy, the CLI."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import zmq

from kvmesh.mock.testing import run_mock
from kvmesh.router.asgi.standalone import build_router_app
from kvmesh.router.core.config import RouterConfig
from kvmesh.router.mesh.registry import WorkerRegistry
from kvmesh.router.mesh.settings import MeshSettings, WorkerSpec
from kvmesh.router.upstream.forwarder import ANSWER_LIMIT
from tests.router.engines import EngineState, engine_app
from tests.router.fleet import chat, fleet
from tests.router.servers import serve
from tests.router.upstream.test_forwarder import endless, raw_server


async def _workers(http: aiohttp.ClientSession, url: str) -> dict[str, dict[str, Any]]:
    async with http.get(url + "/kvmesh/workers") as r:
        return {row["url"]: row for row in (await r.json())["workers"]}


async def _until_state(http: aiohttp.ClientSession, front: str, worker: str, state: str) -> None:
    for _ in range(200):
        if (await _workers(http, front))[worker]["state"] == state:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{worker} never became {state}: {await _workers(http, front)}")


async def test_a_worker_with_another_block_size_is_refused_loudly(http: aiohttp.ClientSession) -> None:
    odd = EngineState("odd", block_size=32)
    async with serve(engine_app(EngineState("e0"))) as good, serve(engine_app(odd)) as bad:
        settings = MeshSettings(
            workers=(WorkerSpec(good.url, good.url), WorkerSpec(bad.url, bad.url)),
            router=RouterConfig(use_kv_events=False),
        )
        async with serve(build_router_app(settings)) as front:
            rows = await _workers(http, front.url)
            assert rows[good.url]["state"] == "up"
            assert rows[bad.url]["state"] == "refused"
            assert (
                rows[bad.url]["reason"]
                == "block size 32 differs from the fleet's 16; KV hashes would never match"
            )
            for _ in range(4):
                async with http.post(front.url + "/v1/chat/completions", json=chat("x")) as r:
                    assert r.status == 200
            assert odd.received == []


@pytest.mark.parametrize(
    ("facts", "reason"),
    [
        ({"block_size": "16"}, "/kvmesh/info.block_size must be a positive integer, got '16'"),
        ({"block_size": 1.5}, "/kvmesh/info.block_size must be a positive integer, got 1.5"),
        ({"total_kv_blocks": 0}, "/kvmesh/info.total_kv_blocks must be a positive integer, got 0"),
        (
            {"max_num_batched_tokens": [8192]},
            "/kvmesh/info.max_num_batched_tokens must be a positive integer",
        ),
        ({"dp_size": 10_000_000}, "/kvmesh/info.dp_size must be at most 1024, got 10000000"),
        (
            {"kv_events_endpoints": {"tcp://127.0.0.1:1": 0}},
            "/kvmesh/info.kv_events_endpoints must be a list",
        ),
        ({"bootstrap_port": "x"}, "/kvmesh/info.bootstrap_port must be a positive integer, got 'x'"),
        ({"tokens_api": "yes"}, "/kvmesh/info.tokens_api must be true or false, got 'yes'"),
        (  # (an engine bound to tcp://*:5557 with no host to advertise: up, its events "live", none read)
            {"kv_events_endpoints": ["tcp://*:5557"]},
            "/kvmesh/info.kv_events_endpoints entry 'tcp://*:5557' names the wildcard host '*', which can "
            "be bound but not connected to; set KVMESH_ADVERTISE_HOST (or KVMESH_SELF_URL) on the engine",
        ),
        (  # (a router on another host dials its own host there: nothing, or its own engine's stream)
            {"kv_events_endpoints": ["tcp://0.0.0.0:5557"]},
            "/kvmesh/info.kv_events_endpoints entry 'tcp://0.0.0.0:5557' names '0.0.0.0', every interface "
            "of the engine's, where a router dials its own host; set KVMESH_ADVERTISE_HOST",
        ),
        (
            {"kv_events_endpoints": ["tcp:/127.0.0.1:5557"]},
            "/kvmesh/info.kv_events_endpoints entry 'tcp:/127.0.0.1:5557' is not a ZMQ endpoint",
        ),
        (
            {"kv_events_endpoints": ["nats:kvmesh.events.*.0"]},
            "/kvmesh/info.kv_events_endpoints entry 'nats:kvmesh.events.*.0' must be a NATS subject",
        ),
        (
            {
                "kv_events_endpoints": ["tcp://127.0.0.1:5557"],
                "kv_replay_endpoints": ["tcp://127.0.0.1:70000"],
            },
            "/kvmesh/info.kv_replay_endpoints entry 'tcp://127.0.0.1:70000' has port '70000'",
        ),
    ],
)
async def test_a_worker_describing_itself_with_a_bad_fact_is_down_naming_it_until_mended(
    http: aiohttp.ClientSession, facts: dict[str, Any], reason: str
) -> None:
    """A text or a list where /kvmesh/info gives a number had left the worker ``pending`` with no
    reason, 1.5 was read as a block size of 1 and a cache of 0 blocks was admitted; ten million
    ranks stalled the router. The worker is kept out of routing, and read again at each health
    check: once its description is sane it is admitted."""
    odd = EngineState("odd", info_facts=facts)
    async with serve(engine_app(EngineState("e0"))) as good, serve(engine_app(odd)) as bad:
        settings = MeshSettings(
            workers=(WorkerSpec(good.url, good.url), WorkerSpec(bad.url, bad.url)),
            router=RouterConfig(use_kv_events=False),
            health_interval=0.05,
        )
        async with serve(build_router_app(settings)) as front:
            await _until_state(http, front.url, bad.url, "down")
            assert (await _workers(http, front.url))[bad.url]["reason"].startswith(reason)
            for _ in range(4):
                async with http.post(front.url + "/v1/chat/completions", json=chat("x")) as r:
                    assert r.status == 200
            assert odd.received == []
            odd.info_facts = {}
            await _until_state(http, front.url, bad.url, "up")


async def test_a_worker_answering_without_end_is_down_naming_the_size(http: aiohttp.ClientSession) -> None:
    """An address in the fleet that answers ``/kvmesh/info`` with an endless body (a wrong URL, a
    broken engine) was read until the timeout at every health check: the router's memory went to
    1.6 GB and back every 3 s. The answer is cut at its limit; the worker is down, saying so, and
    the rest of the fleet routes."""
    async with serve(engine_app(EngineState("e0"))) as good, raw_server(endless) as bad:
        settings = MeshSettings(
            workers=(WorkerSpec(good.url, good.url), WorkerSpec(bad.url, bad.url)),
            router=RouterConfig(use_kv_events=False),
            health_interval=0.05,
            connect_timeout=30.0,
        )
        async with serve(build_router_app(settings)) as front:
            await _until_state(http, front.url, bad.url, "down")
            reason = (await _workers(http, front.url))[bad.url]["reason"]
            assert f"response larger than {ANSWER_LIMIT} bytes" in reason, reason
            async with http.post(front.url + "/v1/chat/completions", json=chat("x")) as r:
                assert r.status == 200
        assert bad.sent < bad.connections * (ANSWER_LIMIT + (16 << 20))


async def test_an_unreadable_kv_state_neither_strands_the_worker_nor_stops_its_health_checks(
    http: aiohttp.ClientSession,
) -> None:
    """A ``kv_state`` whose sequence number is not a number raised out of the worker's admission
    (only kvmesh's own errors are caught there): the worker stayed ``pending`` for good, with no
    reason. It is taken as unavailable now, there and at the health checks that read it again (a
    quiet stream with no replay socket is checked against it): the worker follows live events
    only, and its checks go on to read the engine's own load."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    quiet = ctx.socket(zmq.PUB)  # an event publisher that publishes nothing
    quiet.setsockopt(zmq.LINGER, 0)
    port = quiet.bind_to_random_port("tcp://127.0.0.1")
    state = EngineState(
        "odd",
        info_facts={"kv_events_endpoints": [f"tcp://127.0.0.1:{port}"]},
        kv_state={"ranks": [{"dp_rank": 0, "last_seq": "soon", "events": []}]},
        metrics='vllm:num_requests_running{model_name="test-model"} 2.0\n'
        'vllm:num_requests_waiting{model_name="test-model"} 3.0\n',
    )
    try:
        async with serve(engine_app(state)) as engine:
            settings = MeshSettings(workers=(WorkerSpec(engine.url, "odd"),), health_interval=0.05)
            async with serve(build_router_app(settings)) as front:
                await _until_state(http, front.url, engine.url, "up")
                for _ in range(250):
                    row = (await _workers(http, front.url))[engine.url]
                    if row.get("engine_load"):
                        break
                    await asyncio.sleep(0.02)
                assert row["engine_load"] is not None, row
                assert (row["engine_load"]["running"], row["engine_load"]["waiting"]) == (2.0, 3.0)
    finally:
        quiet.close(linger=0)


async def test_a_fault_nothing_foresaw_is_visible_and_tried_again(
    http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An error outside kvmesh's own, in the admission or in a health check, stands for any fault
    no rule foresaw (this stop's kv_state and /kvmesh/info defects were such). In the admission it
    had left the worker ``pending`` for good with no reason; in a health check it was dropped
    without a word. Now the worker is ``down`` with the error as its reason and admitted once the
    fault clears, and a failing check is logged once, not at every check."""
    faults = {"admit": True, "check": False}
    failed_checks = 0
    admit_once, routine = WorkerRegistry._admit_once, WorkerRegistry._routine

    async def faulty_admit(self: WorkerRegistry, w: Any) -> None:
        if faults["admit"]:
            raise RuntimeError("admission fault")
        await admit_once(self, w)

    async def faulty_routine(self: WorkerRegistry, w: Any) -> None:
        nonlocal failed_checks
        if faults["check"]:
            failed_checks += 1
            raise RuntimeError("check fault")
        await routine(self, w)

    monkeypatch.setattr(WorkerRegistry, "_admit_once", faulty_admit)
    monkeypatch.setattr(WorkerRegistry, "_routine", faulty_routine)
    async with serve(engine_app(EngineState("e0"))) as engine:
        settings = MeshSettings(
            workers=(WorkerSpec(engine.url, "e0"),),
            router=RouterConfig(use_kv_events=False),
            health_interval=0.02,
        )
        async with serve(build_router_app(settings)) as front:
            await _until_state(http, front.url, engine.url, "down")
            row = (await _workers(http, front.url))[engine.url]
            assert row["reason"] == "admission failed: RuntimeError('admission fault')"
            faults["admit"] = False
            await _until_state(http, front.url, engine.url, "up")
            caplog.clear()
            faults["check"] = True
            for _ in range(500):  # until a dozen checks have failed (counted, not timed)
                if failed_checks >= 12:
                    break
                await asyncio.sleep(0.01)
            assert failed_checks >= 12
            logged = [r for r in caplog.records if "a health check failed" in r.getMessage()]
            assert len(logged) == 1 and "check fault" in logged[0].getMessage()
            assert (await _workers(http, front.url))[engine.url]["state"] == "up"


async def test_a_dead_worker_leaves_routing_and_is_readmitted_when_it_returns(
    http: aiohttp.ClientSession,
) -> None:
    async with fleet(2, router=RouterConfig(router_mode="round-robin")) as (front, states, engines):
        port = int(engines[1].url.rsplit(":", 1)[1])
        engines[1].crash()
        await _until_state(http, front.url, engines[1].url, "down")
        for _ in range(4):
            async with http.post(front.url + "/v1/chat/completions", json=chat("x")) as r:
                assert r.status == 200
        served_while_down = len(states[0].received)
        assert served_while_down >= 4
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        revived = EngineState("revived")
        async with serve(engine_app(revived), sock):
            await _until_state(http, front.url, engines[1].url, "up")
            for _ in range(4):
                async with http.post(front.url + "/v1/chat/completions", json=chat("x")) as r:
                    assert r.status == 200
            assert len(revived.received) == 2


async def test_all_workers_busy_is_503_with_retry_after(http: aiohttp.ClientSession) -> None:
    config = RouterConfig(use_kv_events=False, active_decode_blocks_threshold=0.0, busy_retry_after_secs=3)
    async with fleet(1, router=config, engine_kwargs={"chunks": 20, "gap": 0.05}) as (front, _, _e):
        body = chat("keep me busy " * 20, stream=True)
        async with http.post(front.url + "/v1/chat/completions", json=body) as first:
            assert first.status == 200  # nothing in flight yet: admitted
            async with http.post(front.url + "/v1/chat/completions", json=chat("and me " * 20)) as second:
                assert second.status == 503
                assert second.headers["retry-after"] == "3"
                assert (await second.json())["error"]["code"] == 503
            await first.read()


async def test_session_control_and_cache_control_reach_the_engine(http: aiohttp.ClientSession) -> None:
    async with run_mock(block_size=16, speedup=50.0) as mock:
        settings = MeshSettings(
            workers=(WorkerSpec(mock.base_url, mock.base_url),),
            router=RouterConfig(enable_cache_control=True),
        )
        async with serve(build_router_app(settings)) as front:
            body = {
                "model": mock.config.model,
                "messages": [{"role": "user", "content": "remember this context " * 20}],
                "max_tokens": 2,
                "nvext": {
                    "session_control": {"session_id": "s-1", "action": "open", "timeout": 30},
                    "cache_control": {"type": "ephemeral", "ttl": "5m"},
                },
            }
            async with http.post(front.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
            for _ in range(100):
                if mock.engine.retention.num_retained > 0:
                    break
                await asyncio.sleep(0.02)
            assert mock.engine.retention.num_retained > 0


@contextlib.asynccontextmanager
async def router_process(worker_url: str, *flags: str) -> AsyncIterator[int]:
    """``kvmesh router --workers worker_url *flags`` as its own process; yields its port once it
    accepts connections."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvmesh", "router", "--workers", worker_url, "--port", str(port),
        "--log-level", "warning", *flags,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        for _ in range(300):
            with contextlib.suppress(OSError):
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.close()
                break
            await asyncio.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        await proc.wait()


async def test_kvmesh_router_command(http: aiohttp.ClientSession) -> None:
    async with (
        run_mock(block_size=16, speedup=50.0) as mock,
        router_process(mock.base_url, "--router-temperature", "0") as port,
    ):
        url = f"http://127.0.0.1:{port}"
        for _ in range(300):
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(url + "/health") as r:
                    if r.status == 200:
                        break
            await asyncio.sleep(0.05)
        async with http.get(url + "/v1/models") as r:
            assert [m["id"] for m in (await r.json())["data"]] == [mock.config.model]
        async with http.get(url + "/v1/models/" + mock.config.model) as r:  # (OpenAI's retrieve)
            assert r.status == 200 and (await r.json())["id"] == mock.config.model
        async with http.get(url + "/v1/models/org/not-served") as r:  # (a name may hold a slash)
            assert r.status == 404 and (await r.json())["error"]["param"] == "model"
        body = {
            "model": mock.config.model,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
        }
        async with http.post(url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
            assert r.headers["x-kvmesh-worker-id"] == mock.base_url


async def test_kvmesh_router_closes_idle_client_connections_after_timeout_keep_alive() -> None:
    async with (
        run_mock(block_size=16, speedup=50.0) as mock,
        router_process(mock.base_url, "--timeout-keep-alive", "0.5") as port,
    ):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: router\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 200")
        length = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:"))[15:])
        await reader.readexactly(length)
        # idle past the timeout: the router closes the connection (EOF), it does not hang on
        assert await asyncio.wait_for(reader.read(1), 10) == b""
        writer.close()
