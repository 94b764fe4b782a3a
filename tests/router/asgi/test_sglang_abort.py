"""SGLang's ``POST /abort_request`` through kvmesh over HTTP: a standalone router in front of mock
engines, and a mesh of engines each embedding the router.

The mock serves ``/abort_request`` as SGLang 0.5.23 does (an abort by ``rid``, or ``abort_all``),
and takes ``rid`` on ``/generate`` and the OpenAI routes. The router may have sent a request to any
engine, so an abort must reach the one that runs it: sent only to the engine the client called, it
stopped nothing there, and the request ran on to its last token.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from kvmesh.commands.demo import start_mesh
from kvmesh.mock.config import MockConfig
from kvmesh.router.asgi.standalone import build_router_app
from kvmesh.router.core.config import RouterConfig
from kvmesh.router.mesh.settings import MeshSettings, WorkerSpec
from tests.router.asgi.test_agent_features import BS, mock_fleet
from tests.router.asgi.test_generate_api import _vllm_like
from tests.router.asgi.test_tokens_api import nothing_runs
from tests.router.servers import serve

LONG = 3000
TEXT = " ".join(f"w{i}" for i in range(6 * BS))


def _generate(rid: str | None, **nvext: Any) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {
        "text": TEXT,
        "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True},
        "stream": True,
        "nvext": nvext,
    }
    if rid is not None:
        body["rid"] = rid
    return "/generate", body


def _chat(rid: str, model: str) -> tuple[str, dict[str, Any]]:
    body = {
        "model": model,
        "rid": rid,
        "messages": [{"role": "user", "content": TEXT}],
        "max_tokens": LONG,
        "ignore_eos": True,
        "stream": True,
    }
    return "/v1/chat/completions", body


async def _stream(
    http: aiohttp.ClientSession, url: str, request: tuple[str, dict[str, Any]], first: asyncio.Event
) -> list[Any]:
    """The events of a stream (``first`` set once one has come), to its ``[DONE]``."""
    path, body = request
    events: list[Any] = []
    async with http.post(url + path, json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if not line.startswith(b"data: "):
                continue
            payload = line[len(b"data: ") :].strip()
            if payload == b"[DONE]":
                return events
            events.append(json.loads(payload))
            first.set()
    raise AssertionError(f"the stream ended without [DONE] after {len(events)} events")


async def _abort(http: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with http.post(url + "/abort_request", json=body) as r:
        return r.status, (await r.json() if r.content_type == "application/json" else await r.text())


def _generated(events: list[Any]) -> tuple[str | None, int]:
    """(how a /generate stream finished, how many tokens it made): each event is the answer so far."""
    last = events[-1]["meta_info"]
    reason = last.get("finish_reason")
    return (reason or {}).get("type"), last["completion_tokens"]


async def test_an_abort_by_rid_through_the_standalone_router_stops_the_request_where_it_runs(
    http: aiohttp.ClientSession,
) -> None:
    async with mock_fleet(3) as (front, mocks, app):
        first = asyncio.Event()
        running = asyncio.create_task(_stream(http, front.url, _generate("rollout-3"), first))
        await asyncio.wait_for(first.wait(), 20)
        assert await _abort(http, front.url, {"rid": "rollout-3"}) == (200, "")
        reason, made = _generated(await asyncio.wait_for(running, 20))
        assert reason == "abort" and made < LONG
        await nothing_runs(mocks, app)


async def test_an_abort_sent_to_another_engine_of_the_mesh_reaches_the_one_running_the_request(
    http: aiohttp.ClientSession,
) -> None:
    """Each engine embeds the router: a request sent to one engine and served by a second is
    aborted by its ``rid`` at a third, and the second stops it; a request without the rid runs on."""
    async with start_mesh(3, RouterConfig(), MockConfig(block_size=BS, speedup=5.0)) as nodes:
        entry, runner, third = (node.url for node in nodes)
        first, other_first = asyncio.Event(), asyncio.Event()
        aborted = asyncio.create_task(
            _stream(http, entry, _generate("rollout-9", backend_instance_id=runner), first)
        )
        model = nodes[0].engine.config.model
        chat = _chat("chat-4", model)
        chat[1]["max_tokens"] = 40
        chat[1]["nvext"] = {"backend_instance_id": runner}
        kept = asyncio.create_task(_stream(http, entry, chat, other_first))
        await asyncio.wait_for(asyncio.gather(first.wait(), other_first.wait()), 20)
        assert (await _abort(http, third, {"rid": "rollout-9"}))[0] == 200
        reason, made = _generated(await asyncio.wait_for(aborted, 30))
        assert reason == "abort" and made < LONG
        events = await asyncio.wait_for(kept, 30)
        assert events[-1]["choices"][0]["finish_reason"] == "length"


async def test_abort_all_stops_the_requests_of_every_engine(http: aiohttp.ClientSession) -> None:
    """Behind kvmesh a request may run on any engine, so ``abort_all`` at one engine stops the
    fleet's: one it runs itself (no rid), one it sent to the other, one the other was sent."""
    async with start_mesh(2, RouterConfig(), MockConfig(block_size=BS, speedup=5.0)) as nodes:
        here, there = (node.url for node in nodes)
        path, chat = _chat("c-2", nodes[0].engine.config.model)
        chat["nvext"] = {"backend_instance_id": here}
        streams = (
            (here, _generate(None, backend_instance_id=here)),
            (here, _generate("g-1", backend_instance_id=there)),
            (there, (path, chat)),
        )
        starts = [asyncio.Event() for _ in streams]
        tasks = [
            asyncio.create_task(_stream(http, url, request, start))
            for (url, request), start in zip(streams, starts, strict=True)
        ]
        await asyncio.wait_for(asyncio.gather(*(start.wait() for start in starts)), 20)
        assert (await _abort(http, here, {"abort_all": True}))[0] == 200
        local, forwarded, chatted = [await asyncio.wait_for(task, 30) for task in tasks]
        assert _generated(local)[0] == "abort" and _generated(forwarded)[0] == "abort"
        assert chatted[-1]["choices"][0]["finish_reason"] == "abort"


async def test_what_the_router_refuses_and_a_fleet_without_sglang(http: aiohttp.ClientSession) -> None:
    async with mock_fleet(1) as (front, _mocks, _app):
        for bad, field in (
            ([1], "body"),
            ({"rid": 7}, "rid"),
            ({"rid": ["a", "b"]}, "rid"),
            ({"rid": "a", "abort_all": "yes"}, "abort_all"),
        ):
            status, error = await _abort(http, front.url, bad)
            assert status == 400 and error["error"]["param"] == field, (bad, error)
        assert await _abort(http, front.url, {"rid": "nobody-runs-this"}) == (200, "")
    async with serve(_vllm_like()) as vllm:  # (no worker's server has /abort_request)
        settings = MeshSettings(workers=(WorkerSpec(vllm.url, "v"),), health_interval=0.2)
        async with serve(build_router_app(settings)) as front:
            status, error = await _abort(http, front.url, {"rid": "x"})
            assert status == 404 and error["error"]["param"] == "path", error
