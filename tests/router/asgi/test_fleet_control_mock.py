"""The standalone router's fleet-wide engine controls on ``kvmesh mock`` engines, over HTTP: a pause
through the router stops what runs on every engine and holds the fleet until the resume, and a sleep
that empties the engines' caches empties the router's picture of them too."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from kvmesh.router.core.config import RouterConfig
from tests.router.asgi.test_agent_features import BS, mock_fleet, until
from tests.router.asgi.test_responses_api import indexed_as_stored

PROMPT = " ".join(f"w{i}" for i in range(5 * BS))


async def _ask(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, Any, str | None]:
    async with http.post(url + "/v1/completions", json=body) as r:
        return r.status, await r.json(), r.headers.get("x-kvmesh-worker-id")


async def test_a_pause_through_the_router_stops_every_engine_until_the_resume(
    http: aiohttp.ClientSession,
) -> None:
    async with mock_fleet(2) as (front, mocks, app):
        model = mocks[0].config.model
        long = {"model": model, "prompt": PROMPT, "max_tokens": 5000, "ignore_eos": True}
        # one long request on each engine
        runs = [
            asyncio.ensure_future(
                _ask(http, front.url, {**long, "nvext": {"backend_instance_id": m.base_url}})
            )
            for m in mocks
        ]
        await until(lambda: all(m.engine.scheduler.num_running == 1 for m in mocks))
        async with http.post(front.url + "/pause") as r:  # (vLLM's default: abort)
            assert r.status == 200, await r.text()
            answer = await r.json()
        assert answer["status"] == "paused" and sorted(answer["workers"]) == sorted(m.base_url for m in mocks)
        for status, body, _ in await asyncio.gather(*runs):
            # (each request was aborted where it ran, well short of its length)
            assert status == 200 and body["usage"]["completion_tokens"] < 5000, body
        async with http.get(front.url + "/is_paused") as r:
            assert (await r.json())["is_paused"] is True
        # while paused the engines refuse new requests, and the router says so
        status, body, _ = await _ask(http, front.url, {**long, "max_tokens": 2})
        assert status == 503, body
        async with http.post(front.url + "/resume") as r:
            assert r.status == 200 and (await r.json())["status"] == "resumed"
        status, body, _ = await _ask(http, front.url, {**long, "max_tokens": 2})
        assert status == 200, body
        router = app.mesh.router
        await until(lambda: all(w.active_requests == 0 for w in router.worker_snapshot()))


@pytest.mark.parametrize("events", [True, False], ids=["kv-events", "predicted"])
async def test_a_sleep_that_empties_the_caches_empties_the_routers_picture(
    http: aiohttp.ClientSession, events: bool
) -> None:
    async with mock_fleet(2, RouterConfig(use_kv_events=events)) as (front, mocks, app):
        body = {"model": mocks[0].config.model, "prompt": PROMPT, "max_tokens": 1}
        router = app.mesh.router
        _, _, home = await _ask(http, front.url, body)
        await until(lambda: not router.tracking(router.recent_decisions(1)[-1][1].request_id))
        if events:  # (the answer can come before the engine's KV events)
            await indexed_as_stored(http, front.url, home)
        _, _, again = await _ask(http, front.url, body)
        assert again == home and router.recent_decisions(1)[-1][1].cached_tokens >= 4 * BS
        await until(lambda: not router.tracking(router.recent_decisions(1)[-1][1].request_id))
        async with http.post(front.url + "/sleep?level=1") as r:
            assert r.status == 200 and (await r.json())["level"] == 1, await r.text()
        async with http.post(front.url + "/wake_up") as r:
            assert r.status == 200 and (await r.json())["status"] == "awake", await r.text()
        assert all(not m.engine.pool.cached for m in mocks)
        await until(lambda: all(w.indexed_blocks == 0 for w in router.worker_snapshot()))
        status, answer, _ = await _ask(http, front.url, body)
        assert status == 200, answer
        assert router.recent_decisions(1)[-1][1].cached_tokens == 0  # (nothing predicted either)
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
