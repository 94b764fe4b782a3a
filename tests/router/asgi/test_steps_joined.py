"""Requests routed right behind another one reach the engine before its step has started, and the
engine takes them into that step: over HTTP, bursts of identical questions through the standalone
router to one simulated engine (engine time at ``--speedup 1``), and ``GET /kvmesh/router`` shows
the router learning it (``steps_joined``), which the latency cost then predicts (unit tests in
tests/router/core/test_latency_cost.py)."""

from __future__ import annotations

import asyncio

import aiohttp

from kvmesh.mock.testing import run_mock
from kvmesh.router.asgi.standalone import build_router_app
from kvmesh.router.mesh.settings import MeshSettings, WorkerSpec
from tests.router.clients import stream_chat
from tests.router.servers import serve


async def test_bursts_of_twins_teach_the_router_that_they_join_the_first_one_s_step(
    http: aiohttp.ClientSession,
) -> None:
    async with run_mock(block_size=16, speedup=1.0) as engine:
        settings = MeshSettings(workers=(WorkerSpec(engine.base_url, "e"),))
        async with serve(build_router_app(settings)) as front:
            for burst in range(8):
                text = f"burst {burst}: " + "the same long question, asked four times at once " * 40
                body = {"model": engine.config.model, "messages": [{"role": "user", "content": text}]}
                await asyncio.gather(
                    *(stream_chat(http, front.url, {**body, "max_tokens": 2}) for _ in range(4))
                )
            async with http.get(front.url + "/kvmesh/router") as r:
                joined = (await r.json())["steps_joined"]
    # the twins (24) were routed while the first one's step was in progress (an idle engine, one
    # burst at a time: a 45 ms step), and the router compared their first tokens with its
    seen = joined["seen"]
    assert sum(seen) >= 20
    # the simulated engine, like vLLM, takes the requests that arrive before a step starts into it:
    # most twins showed their first token with the first one's (measured: 83-92% of them)
    together = sum(n * share for n, share in zip(seen, joined["joined_share"], strict=True))
    assert together > 0.5 * sum(seen)
