"""Requests naming a stored response or an SGLang session the router was not told of, over HTTP:
the fleet is searched once per id at a time, and an id nobody held is not searched for again at
once (kvmesh.router.mesh.holder_search). Before, each such request asked every engine."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.commands.demo import start_mesh
from kvmesh.mock.config import MockConfig
from kvmesh.router.core.config import RouterConfig
from tests.router.asgi.test_agent_features import BS
from tests.router.engines import EngineState, engine_app
from tests.router.servers import serve
from tests.router.upstream.test_forwarder import router_for


async def _all_up(http: aiohttp.ClientSession, front: str, n: int) -> None:
    for _ in range(500):
        async with http.get(front + "/kvmesh/workers") as r:
            if [row["state"] for row in (await r.json())["workers"]] == ["up"] * n:
                return
        await asyncio.sleep(0.01)
    raise AssertionError("the workers never came up")


async def _fetch(
    http: aiohttp.ClientSession, front: str, response_id: str, auth: str | None = None
) -> tuple[int, Any]:
    headers = {"authorization": auth} if auth else {}
    async with http.get(f"{front}/v1/responses/{response_id}", headers=headers) as r:
        return r.status, await r.json()


async def test_requests_naming_an_unknown_response_ask_each_engine_once(http: aiohttp.ClientSession) -> None:
    """A burst of requests for a response nobody holds (vLLM with its store off, a made-up id)
    is one ask per engine, and so are the requests that follow it at once; another credential is
    asked for afresh; a response an engine stores later is found once the miss is forgotten."""
    states = [EngineState(f"e{i}", stored_delay=0.2) for i in range(3)]
    async with contextlib.AsyncExitStack() as stack:
        engines = [await stack.enter_async_context(serve(engine_app(s))) for s in states]
        front = await stack.enter_async_context(router_for(*(e.url for e in engines), health_interval=0.2))
        await _all_up(http, front, 3)

        burst = await asyncio.gather(*(_fetch(http, front, "resp_nobody") for _ in range(20)))
        assert {(status, doc["error"]["param"]) for status, doc in burst} == {(404, "response_id")}
        assert [len(s.stored_asks) for s in states] == [1, 1, 1]
        for _ in range(5):  # just after: the miss is remembered
            status, doc = await _fetch(http, front, "resp_nobody")
            assert (status, doc["error"]["param"]) == (404, "response_id")
        assert [len(s.stored_asks) for s in states] == [1, 1, 1]

        # An engine's store is behind its API key: another credential's miss is its own.
        status, _ = await _fetch(http, front, "resp_nobody", auth="Bearer another-key")
        assert status == 404
        assert [s.stored_asks[-1] for s in states] == [("resp_nobody", "Bearer another-key")] * 3

        states[2].stored["resp_nobody"] = {"id": "resp_nobody", "object": "response", "output": []}
        for _ in range(100):  # (the miss is forgotten after a moment: two seconds)
            status, doc = await _fetch(http, front, "resp_nobody")
            if status == 200:
                break
            await asyncio.sleep(0.1)
        assert (status, doc["id"]) == (200, "resp_nobody")
        asked = [len(s.stored_asks) for s in states]
        status, _ = await _fetch(http, front, "resp_nobody")  # found: remembered, not searched
        assert status == 200
        assert [len(s.stored_asks) for s in states] == [asked[0], asked[1], asked[2] + 1]


async def test_a_miss_is_not_remembered_while_a_worker_did_not_answer(http: aiohttp.ClientSession) -> None:
    """An engine that does not answer in time (2 s) may hold the response: not a miss to keep."""
    states = [EngineState("e0"), EngineState("e1", stored_delay=2.5)]
    async with contextlib.AsyncExitStack() as stack:
        engines = [await stack.enter_async_context(serve(engine_app(s))) for s in states]
        front = await stack.enter_async_context(router_for(*(e.url for e in engines), health_interval=0.2))
        await _all_up(http, front, 2)
        for asked in (1, 2):
            status, doc = await _fetch(http, front, "resp_slow")
            assert (status, doc["error"]["param"]) == (404, "response_id")
            assert [len(s.stored_asks) for s in states] == [asked, asked]  # (searched again)


async def test_a_client_leaving_does_not_stop_the_search_others_wait_for(http: aiohttp.ClientSession) -> None:
    states = [EngineState(f"e{i}", stored_delay=0.3) for i in range(2)]
    states[1].stored["resp_kept"] = {"id": "resp_kept", "object": "response", "output": []}
    async with contextlib.AsyncExitStack() as stack:
        engines = [await stack.enter_async_context(serve(engine_app(s))) for s in states]
        front = await stack.enter_async_context(router_for(*(e.url for e in engines), health_interval=0.2))
        await _all_up(http, front, 2)
        leaving = asyncio.create_task(_fetch(http, front, "resp_kept"))
        await asyncio.sleep(0.1)  # (its search is running)
        staying = asyncio.create_task(_fetch(http, front, "resp_kept"))
        await asyncio.sleep(0.05)
        leaving.cancel()
        status, doc = await staying
        assert (status, doc["id"]) == (200, "resp_kept")
        assert [len(s.stored_asks) for s in states] == [1, 2]  # one search, then the answer itself


async def _searches(http: aiohttp.ClientSession, url: str) -> dict[tuple[str, str], float]:
    """This router's ``kvmesh_holder_searches_total`` by (kind, outcome), from its ``/metrics``."""
    async with http.get(url + "/kvmesh/router") as r:
        replica = (await r.json())["replica"]
    async with http.get(url + "/metrics") as r:
        exposition = await r.text()
    return {
        (s.labels["kind"], s.labels["outcome"]): s.value
        for family in text_string_to_metric_families(exposition)
        for s in family.samples
        if s.name == "kvmesh_holder_searches_total" and s.labels["replica"] == replica
    }


async def test_inside_the_engines_an_unknown_session_is_searched_for_once(
    http: aiohttp.ClientSession,
) -> None:
    """A burst of SGLang session requests naming an id no engine opened (an RL loop after its
    engine restarted) asks the peers once; each request gets its engine's own refusal."""
    async with start_mesh(3, RouterConfig(), MockConfig(block_size=BS, speedup=50.0)) as nodes:
        entry = nodes[0].url
        body = {"text": "A turn.", "session_params": {"id": "lost"}, "sampling_params": {"max_new_tokens": 2}}

        async def turn() -> tuple[int, Any]:
            async with http.post(entry + "/generate", json=body) as r:
                return r.status, await r.json()

        answers = await asyncio.gather(*(turn() for _ in range(8)))
        assert {(status, doc["error"]["param"]) for status, doc in answers} == {(400, "session_params.id")}
        counts = await _searches(http, entry)
        assert counts[("sglang_session", "searched")] == 1
        assert counts[("sglang_session", "found")] == 0
        assert counts[("sglang_session", "joined")] + counts[("sglang_session", "remembered")] == 7
