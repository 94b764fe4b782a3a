"""A worker that refuses a request for now (kvmesh.router.asgi.forwarding.refused_for_now: a 503,
or a stream that opens with a 503 error, as a paused vLLM engine answers) ran none of it: the
router sends the request to another worker, over HTTP, and the client sees only the answer."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from kvmesh.commands.demo import start_mesh
from kvmesh.mock.config import MockConfig
from kvmesh.mock.testing import run_mock
from kvmesh.router.asgi.forwarding import refused_for_now
from kvmesh.router.asgi.standalone import build_router_app
from kvmesh.router.core.config import RouterConfig
from kvmesh.router.mesh import runtime
from kvmesh.router.mesh.metrics import get_metrics
from kvmesh.router.mesh.settings import MeshSettings, WorkerSpec
from tests.router.asgi.test_agent_features import mock_fleet
from tests.router.asgi.test_responses_api import indexed_as_stored
from tests.router.engines import EngineState, engine_app
from tests.router.fleet import chat
from tests.router.servers import serve
from tests.router.upstream.test_forwarder import router_for


def _rerouted() -> float:
    return get_metrics().refusals_rerouted._value.get()


@contextlib.asynccontextmanager
async def _pair(refusing: EngineState) -> AsyncIterator[tuple[str, str, str]]:
    """A round-robin router in front of ``refusing`` and a worker that serves: (front, its url,
    the server's url)."""
    serving = EngineState("serving")
    async with (
        serve(engine_app(refusing)) as a,
        serve(engine_app(serving)) as b,
        router_for(a.url, b.url) as front,
    ):
        yield front, a.url, b.url


async def _ask(http: aiohttp.ClientSession, front: str, **body: Any) -> tuple[int, str, str | None]:
    async with http.post(front + "/v1/chat/completions", json={**chat("q"), **body}) as r:
        return r.status, await r.text(), r.headers.get("x-kvmesh-worker-id")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_refused_request_is_served_by_another_worker(
    http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    monkeypatch.setattr(runtime, "REFUSAL_HOLD_S", 60.0)  # (no hold ends while the test runs)
    refusing = EngineState(
        "refusing", status=503 if not stream else 200, stream_error=503 if stream else None
    )
    async with _pair(refusing) as (front, _, serving_url):
        before = _rerouted()
        for _ in range(4):  # (round-robin: the refusing worker is sent the first or second)
            status, text, worker = await _ask(http, front, stream=stream)
            assert status == 200 and worker == serving_url, text
            assert "serving" in text and "refused" not in text
        # once refused, the worker is passed over for a while: asked once, not every other time
        assert len(refusing.received) == 1 and _rerouted() - before == 1
        async with http.get(front + "/kvmesh/workers") as r:  # (refusing is not being down)
            assert {row["state"] for row in (await r.json())["workers"]} == {"up"}


async def test_a_refusing_worker_is_asked_again_after_the_hold(
    http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A paused engine resumes: once its hold has passed it is a candidate again (with no hold it
    was asked first by every request whose best worker it was, and refused each). The hold's end is
    brought forward rather than waited for (no timing in the test)."""
    monkeypatch.setattr(runtime, "REFUSAL_HOLD_S", 60.0)
    refusing, serving = EngineState("refusing", status=503), EngineState("serving")
    async with serve(engine_app(refusing)) as a, serve(engine_app(serving)) as b:
        settings = MeshSettings(
            workers=(WorkerSpec(a.url, a.url), WorkerSpec(b.url, b.url)),
            router=RouterConfig(router_mode="round-robin"),
            health_interval=5.0,
        )
        app = build_router_app(settings)
        async with serve(app) as front:
            for _ in range(4):
                assert (await _ask(http, front.url))[2] == b.url
            assert len(refusing.received) == 1 and set(app.mesh.refusing) == {a.url}
            refusing.status = 200  # (it resumed)
            app.mesh.refusing[a.url] = time.monotonic() - 1.0  # (and its hold has passed)
            served = [(await _ask(http, front.url))[2] for _ in range(4)]
            assert set(served) == {a.url, b.url} and len(refusing.received) >= 2
            assert app.mesh.refusing == {}


async def test_a_pinned_request_or_a_fleet_that_refuses_gets_the_refusal(http: aiohttp.ClientSession) -> None:
    refusing = EngineState("refusing", status=503)
    async with _pair(refusing) as (front, refusing_url, _):
        status, text, _ = await _ask(http, front, nvext={"backend_instance_id": refusing_url})
        assert status == 503 and "failing on purpose" in text
    every = [EngineState("a", status=503), EngineState("b", status=503)]
    async with (
        serve(engine_app(every[0])) as a,
        serve(engine_app(every[1])) as b,
        router_for(a.url, b.url) as front,
    ):
        status, text, _ = await _ask(http, front)
        assert status == 503 and "failing on purpose" in text
        assert len(every[0].received) + len(every[1].received) == 2  # (each asked once)


async def test_other_errors_are_the_clients_as_they_came(http: aiohttp.ClientSession) -> None:
    for refusing in (EngineState("e", status=500), EngineState("e", stream_error=400)):
        async with _pair(refusing) as (front, _, _):
            before = _rerouted()
            outcomes = [await _ask(http, front, stream=refusing.stream_error is not None) for _ in range(2)]
            assert any("failing on purpose" in t or "refused in the stream" in t for _, t, _ in outcomes)
            assert _rerouted() == before


def test_what_counts_as_a_refusal_for_now() -> None:
    event = (
        b"data: " + json.dumps({"error": {"message": "m", "type": "t", "param": None, "code": 503}}).encode()
    )
    assert refused_for_now(503, b"{}") and refused_for_now(200, event + b"\n\ndata: [DONE]\n\n")
    assert not refused_for_now(200, event.replace(b"503", b"400") + b"\n\n")
    assert not refused_for_now(500, b"{}") and not refused_for_now(200, b'data: {"error": [1]}\n\n')
    assert not refused_for_now(200, b'data: {"error": oops\n\n') and not refused_for_now(200, None)


async def test_an_engine_paused_on_its_own_is_routed_around_until_it_resumes(
    http: aiohttp.ClientSession,
) -> None:
    """A rolling weight update pauses one engine at a time, at the engine itself. The prompt is
    cached on the paused engine, so the router chooses it first each time."""
    async with mock_fleet(2) as (front, mocks, app):
        home, other = mocks[0].base_url, mocks[1].base_url
        app.mesh.registry.workers[home].reads_pause = False  # (the refusals alone tell it here)
        body = {"model": mocks[0].config.model, "prompt": "one engine at a time " * 20, "max_tokens": 2}
        async with http.post(
            front.url + "/v1/completions", json={**body, "nvext": {"backend_instance_id": home}}
        ) as r:
            assert r.status == 200
        await indexed_as_stored(http, front.url, home)
        async with http.post(home + "/pause?clear_cache=false") as r:
            assert r.status == 200
        before = _rerouted()
        for stream in (False, True, False, True):
            async with http.post(front.url + "/v1/completions", json={**body, "stream": stream}) as r:
                assert r.status == 200, await r.text()
                assert r.headers["x-kvmesh-worker-id"] == other
                await r.read()
        assert _rerouted() - before >= 1  # (once the answer was cached there too, it went there first)
        async with http.post(home + "/resume") as r:
            assert r.status == 200
        pinned = {**body, "nvext": {"backend_instance_id": home}}  # (it serves again once resumed)
        async with http.post(front.url + "/v1/completions", json=pinned) as r:
            assert r.status == 200 and r.headers["x-kvmesh-worker-id"] == home


async def test_an_sglang_engine_paused_on_its_own_is_passed_over_until_it_continues(
    http: aiohttp.ClientSession,
) -> None:
    """SGLang's pause refuses nothing: a request sent to a paused engine waits there until
    ``/continue_generation`` (a weight update: seconds to minutes), while the engine answers its
    health checks. Its ``/ready`` answers 503 meanwhile: the router reads it at each health check
    and sends the prompt cached on the paused engine to another worker, served at once. Without
    that, the prompt went to its cache and waited."""
    async with mock_fleet(2) as (front, mocks, app):
        home, other = mocks[0].base_url, mocks[1].base_url
        body = {"model": mocks[0].config.model, "prompt": "a weight update " * 20, "max_tokens": 2}
        pinned = {**body, "nvext": {"backend_instance_id": home}}
        async with http.post(front.url + "/v1/completions", json=pinned) as r:
            assert r.status == 200
        await indexed_as_stored(http, front.url, home)

        async def paused_row() -> bool:
            async with http.get(front.url + "/kvmesh/workers") as r:
                return bool({row["url"]: row for row in (await r.json())["workers"]}[home]["paused"])

        assert not await paused_row()
        async with http.post(home + "/pause_generation", json={"mode": "in_place"}) as r:
            assert r.status == 200
        async with asyncio.timeout(10):
            while not await paused_row():
                await asyncio.sleep(0.05)
        before = _rerouted()
        for stream in (False, True, False):
            async with (
                asyncio.timeout(10),
                http.post(front.url + "/v1/completions", json={**body, "stream": stream}) as r,
            ):
                assert r.status == 200, await r.text()
                assert r.headers["x-kvmesh-worker-id"] == other
                await r.read()
        assert _rerouted() == before  # (nothing was refused: the paused engine was not asked)
        async with http.post(home + "/continue_generation", json={}) as r:
            assert r.status == 200
        async with asyncio.timeout(10):
            while await paused_row():
                await asyncio.sleep(0.05)
        assert app.mesh.registry.paused == frozenset()
        async with asyncio.timeout(10), http.post(front.url + "/v1/completions", json=pinned) as r:
            assert r.status == 200 and r.headers["x-kvmesh-worker-id"] == home


def _says_paused(state: EngineState, paused: bool) -> None:
    if state.backend == "sglang":
        state.ready = 503 if paused else 200
    else:
        state.is_paused = paused


@pytest.mark.parametrize("backend", ["sglang", "vllm"])
async def test_an_engine_that_says_it_is_paused_is_passed_over_until_it_says_it_resumed(
    http: aiohttp.ClientSession, backend: str
) -> None:
    """What each engine says: SGLang's ``/ready`` answers 503 while paused, vLLM's ``/is_paused``
    ``{"is_paused": true}`` (a sleeping vLLM, or one paused in ``keep`` mode, queues what it is
    sent; one paused otherwise refuses it). A round-robin router sends it nothing meanwhile."""
    paused, serving = EngineState("paused", backend=backend), EngineState("serving", backend=backend)
    _says_paused(paused, True)
    _says_paused(serving, False)
    async with (
        serve(engine_app(paused)) as a,
        serve(engine_app(serving)) as b,
        router_for(a.url, b.url, health_interval=0.05) as front,
    ):

        async def rows() -> dict[str, Any]:
            async with http.get(front + "/kvmesh/workers") as r:
                return {row["url"]: row for row in (await r.json())["workers"]}

        async with asyncio.timeout(10):
            while not ((got := await rows())[a.url]["paused"] and got[b.url]["state"] == "up"):
                await asyncio.sleep(0.02)
        for _ in range(4):
            assert (await _ask(http, front))[2] == b.url
        assert paused.received == [] and not (await rows())[b.url]["paused"]
        _says_paused(paused, False)
        async with asyncio.timeout(10):
            while (await rows())[a.url]["paused"]:
                await asyncio.sleep(0.02)
        assert {(await _ask(http, front))[2] for _ in range(4)} == {a.url, b.url}


async def test_an_engine_that_cannot_say_it_is_paused_is_asked_once() -> None:
    """A vLLM without its dev-mode routes answers ``/is_paused`` 404: asked once, never again."""
    plain = EngineState("plain", backend="vllm")
    async with serve(engine_app(plain)) as a, router_for(a.url, health_interval=0.05):
        async with asyncio.timeout(10):
            while plain.pause_asks == 0:
                await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)  # (six more health checks)
        assert plain.pause_asks == 1


async def _local_paused(http: aiohttp.ClientSession, url: str) -> list[bool]:
    """``paused`` of the engine's own row in its router's ``/kvmesh/workers``."""
    async with http.get(url + "/kvmesh/workers") as r:
        return [row["paused"] for row in (await r.json())["workers"] if row["local"]]


async def test_inside_the_engines_a_paused_engine_sends_its_own_requests_to_a_peer(
    http: aiohttp.ClientSession,
) -> None:
    """Each engine's router reads its own engine in process: an engine paused with SGLang's
    ``/pause_generation`` sends the requests it is given to a peer while paused (it would hold
    them), and serves them itself once continued."""
    mock = MockConfig(block_size=16, num_blocks=2048, speedup=50.0)
    async with start_mesh(2, RouterConfig(), mock, health_interval=0.05) as nodes:
        paused, peer = nodes

        async with http.post(paused.url + "/pause_generation", json={"mode": "in_place"}) as r:
            assert r.status == 200
        async with asyncio.timeout(10):
            while await _local_paused(http, paused.url) != [True]:
                await asyncio.sleep(0.02)
        body = {"model": mock.model, "prompt": "held while paused " * 20, "max_tokens": 2}
        for _ in range(2):
            async with asyncio.timeout(10), http.post(paused.url + "/v1/completions", json=body) as r:
                assert r.status == 200 and r.headers["x-kvmesh-worker-id"] == peer.url
        async with http.post(paused.url + "/continue_generation", json={}) as r:
            assert r.status == 200
        async with asyncio.timeout(10):
            while await _local_paused(http, paused.url) != [False]:
                await asyncio.sleep(0.02)


async def test_a_pause_sent_through_an_engines_router_is_known_at_once(http: aiohttp.ClientSession) -> None:
    """Inside the engines, a pause sent to an engine passes its router, which reads the engine's
    state before the pause is answered: the requests that follow go to the peer at once, not
    after the next health check (here 30 s away)."""
    mock = MockConfig(block_size=16, num_blocks=2048, speedup=50.0)
    async with start_mesh(2, RouterConfig(), mock, health_interval=30.0) as nodes:
        paused, peer = nodes

        async with http.post(paused.url + "/pause_generation", json={"mode": "in_place"}) as r:
            assert r.status == 200
        assert await _local_paused(http, paused.url) == [True]
        body = {"model": mock.model, "prompt": "sent just after the pause " * 20, "max_tokens": 2}
        async with asyncio.timeout(10), http.post(paused.url + "/v1/completions", json=body) as r:
            assert r.status == 200 and r.headers["x-kvmesh-worker-id"] == peer.url
        async with http.post(paused.url + "/continue_generation", json={}) as r:
            assert r.status == 200
        assert await _local_paused(http, paused.url) == [False]


async def test_a_fleet_paused_through_the_standalone_router_is_known_at_once(
    http: aiohttp.ClientSession,
) -> None:
    """The standalone router sends a pause to every worker and reads their state before it
    answers; a resume likewise, so none is left passed over until the next health check."""
    async with contextlib.AsyncExitStack() as stack:
        mocks = [await stack.enter_async_context(run_mock(block_size=16, speedup=50.0)) for _ in range(2)]
        settings = MeshSettings(
            workers=tuple(WorkerSpec(m.base_url, m.base_url) for m in mocks), health_interval=30.0
        )
        front = (await stack.enter_async_context(serve(build_router_app(settings)))).url

        async def rows() -> dict[str, tuple[str, bool]]:
            async with http.get(front + "/kvmesh/workers") as r:
                return {row["url"]: (row["state"], row["paused"]) for row in (await r.json())["workers"]}

        async with asyncio.timeout(10):
            while {state for state, _ in (await rows()).values()} != {"up"}:
                await asyncio.sleep(0.02)
        async with http.post(front + "/pause_generation", json={"mode": "in_place"}) as r:
            assert r.status == 200, await r.text()
        assert {paused for _, paused in (await rows()).values()} == {True}
        async with http.post(front + "/continue_generation", json={}) as r:
            assert r.status == 200, await r.text()
        assert {paused for _, paused in (await rows()).values()} == {False}
