"""The standalone router's ``/flush_cache`` and ``/reset_prefix_cache`` over HTTP: one call empties
the prefix cache of every worker (mock engines through kvmesh's worker RPC, stock servers through
their engine's own path), and the router forgets what it predicted they cache."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from kvmesh.router.asgi.standalone import build_router_app
from kvmesh.router.core.config import RouterConfig
from kvmesh.router.mesh.settings import MeshSettings, WorkerSpec
from tests.router.asgi.test_agent_features import BS, mock_fleet, until
from tests.router.asgi.test_responses_api import indexed_as_stored
from tests.router.servers import serve

PROMPT = " ".join(f"w{i}" for i in range(5 * BS))


async def _completion(http: aiohttp.ClientSession, url: str, model: str) -> tuple[str, int]:
    """(the worker that served the prompt, the cached tokens its engine reported)."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": 1}
    async with http.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        answer = await r.json()
        return r.headers["x-kvmesh-worker-id"], answer["usage"]["prompt_tokens_details"]["cached_tokens"]


async def _flush(
    http: aiohttp.ClientSession, url: str, path: str = "/flush_cache", **kw: Any
) -> tuple[int, Any]:
    async with http.post(url + path, **kw) as r:
        return r.status, await r.json()


@pytest.mark.parametrize("events", [True, False], ids=["kv-events", "predicted"])
async def test_one_flush_empties_every_engines_cache_and_the_routers_predictions(
    http: aiohttp.ClientSession, events: bool
) -> None:
    """The router reads the engines' caches from their KV events, or predicts them."""
    async with mock_fleet(2, RouterConfig(use_kv_events=events)) as (front, mocks, app):
        model = mocks[0].config.model
        router = app.mesh.router
        home, _ = await _completion(http, front.url, model)
        if events:  # (the answer can come before the engine's KV events)
            await indexed_as_stored(http, front.url, home)
        again, cached = await _completion(http, front.url, model)
        assert again == home and cached >= 4 * BS
        await until(lambda: not router.tracking(router.recent_decisions(1)[-1][1].request_id))
        status, answer = await _flush(http, front.url, "/flush_cache" if events else "/reset_prefix_cache")
        assert status == 200 and answer == {"flushed": sorted(m.base_url for m in mocks)}, answer
        assert all(not m.engine.pool.cached for m in mocks)
        # (with events, once the engines' "all blocks cleared" has come)
        await until(lambda: all(w.indexed_blocks == 0 for w in router.worker_snapshot()))
        _, cached = await _completion(http, front.url, model)
        assert cached == 0
        assert router.recent_decisions(1)[-1][1].cached_tokens == 0


@contextlib.asynccontextmanager
async def _stock(refuse: bool = False) -> AsyncIterator[tuple[str, str, list[str]]]:
    """A stock SGLang and a stock vLLM (no kvmesh RPCs): their URLs and the flushes they were asked."""
    asked: list[str] = []

    async def flush_cache(request: Request) -> Response:
        asked.append(f"sglang {request.method} {request.headers.get('authorization')}")
        if refuse:
            return PlainTextResponse("Cache not flushed: requests are running", status_code=400)
        return PlainTextResponse("Cache flushed.")

    async def reset_prefix_cache(request: Request) -> Response:
        asked.append(f"vllm {request.url.query}")
        return Response(status_code=200)

    async def ok(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model"}]})

    sglang = Starlette(
        routes=[Route("/flush_cache", flush_cache, methods=["GET", "POST"]), Route("/v1/models", ok)]
    )
    vllm = Starlette(
        routes=[Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]), Route("/v1/models", ok)]
    )
    async with serve(sglang) as s, serve(vllm) as v:
        yield s.url, v.url, asked


async def test_stock_engines_are_flushed_through_their_own_paths(http: aiohttp.ClientSession) -> None:
    async with _stock() as (sglang, vllm, asked):
        workers = (WorkerSpec(sglang, "s", backend="sglang"), WorkerSpec(vllm, "v", backend="vllm"))
        settings = MeshSettings(
            workers=workers, router=RouterConfig(use_kv_events=False), health_interval=0.2
        )
        async with serve(build_router_app(settings)) as front:
            status, answer = await _flush(
                http,
                front.url,
                "/reset_prefix_cache?reset_running_requests=true",
                headers={"authorization": "Bearer k"},
            )
            assert status == 200 and answer == {"flushed": ["s", "v"]}, answer
            assert sorted(asked) == ["sglang POST Bearer k", "vllm reset_running_requests=true"]
            async with http.get(front.url + "/flush_cache") as r:  # (SGLang takes GET too)
                assert r.status == 200


async def test_a_worker_that_does_not_flush_is_named_and_the_admin_token_is_required(
    http: aiohttp.ClientSession,
) -> None:
    async with _stock(refuse=True) as (sglang, vllm, asked):
        workers = (WorkerSpec(sglang, "s", backend="sglang"), WorkerSpec(vllm, "v", backend="vllm"))
        settings = MeshSettings(
            workers=workers, router=RouterConfig(use_kv_events=False), health_interval=0.2, admin_token="t"
        )
        async with serve(build_router_app(settings)) as front:
            status, answer = await _flush(http, front.url)
            assert status == 401, answer
            status, answer = await _flush(http, front.url, headers={"x-kvmesh-admin-token": "t"})
            assert status == 502 and answer["flushed"] == ["v"], answer
            assert list(answer["failed"]) == ["s"] and "requests are running" in answer["failed"]["s"]
            assert answer["error"]["code"] == 502
            asked.clear()
            status, _ = await _flush(http, front.url, headers={"authorization": "Bearer t"})
            assert status == 502 and "sglang POST None" in asked  # (the router's token goes nowhere)
