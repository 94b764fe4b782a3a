"""LoRA: a request whose model names an adapter is hashed with the adapter's seed, like the
engine salts that adapter's blocks, and goes only to workers serving the adapter. SageMaker's
``/invocations`` names the adapter in a header, which vLLM writes into the body's model."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvmesh.events.publisher import KvEventPublisher
from kvmesh.router.asgi.standalone import build_router_app
from kvmesh.router.mesh.settings import MeshSettings, WorkerSpec
from kvmesh.router.request.invocations import ADAPTER_HEADER
from tests.router.servers import serve

BASE = "base-model"
ADAPTER = "sql-lora"
PROMPT = list(range(100, 164))  # four full blocks of 16


@contextlib.contextmanager
def _publisher() -> Iterator[KvEventPublisher]:
    pub = KvEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", block_size=16)
    try:
        yield pub
    finally:
        pub.close()


def _upstream(
    pub: KvEventPublisher, adapters: list[str], source: str, received: list[str], backend: str = "fake"
) -> Starlette:
    """An engine that serves ``adapters`` and says so in its info or in its model list; its
    ``/invocations`` reads the model as vLLM's does (SageMaker's adapter header, or the base
    model), or, for ``backend`` "sglang", as SGLang's chat route does (the body's)."""

    async def info(request: Request) -> Response:
        doc: dict[str, Any] = {
            "backend": backend,
            "model": BASE,
            "block_size": 16,
            "dp_size": 1,
            "kv_events_endpoints": [pub.endpoint],
            "kv_replay_endpoints": [pub.replay_endpoint],
            "max_num_batched_tokens": 8192,
            "total_kv_blocks": 1000,
        }
        if source == "info":
            doc["lora_adapters"] = adapters
        return JSONResponse(doc)

    async def models(request: Request) -> Response:
        data = [{"id": BASE, "object": "model", "root": "/models/base", "parent": None}]
        if source == "models":
            data += [{"id": a, "object": "model", "root": f"/adapters/{a}", "parent": BASE} for a in adapters]
        return JSONResponse({"object": "list", "data": data})

    async def completions(request: Request) -> Response:
        body = await request.json()
        if request.url.path == "/invocations" and backend != "sglang":  # (vLLM's SageMaker route:
            # the header names the model, or none, and the base model serves it)
            body["model"] = request.headers.get(ADAPTER_HEADER.decode()) or BASE
        received.append(body["model"])
        usage = {"prompt_tokens": len(PROMPT), "completion_tokens": 1, "total_tokens": len(PROMPT) + 1}
        return JSONResponse(
            {"id": "cmpl-1", "object": "text_completion", "model": body["model"],
             "choices": [{"index": 0, "text": "x"}], "usage": usage}
        )  # fmt: skip

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    return Starlette(
        routes=[
            Route("/kvmesh/info", info),
            Route("/v1/models", models),
            Route("/health", health),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/invocations", completions, methods=["POST"]),
        ]
    )


@contextlib.asynccontextmanager
async def _two_caches(
    source: str, got_x: list[str], got_y: list[str], backend: str = "fake"
) -> AsyncIterator[tuple[str, Any]]:
    """A router in front of x, which serves the adapter and cached PROMPT under it, and y, which
    serves only the base model and cached PROMPT under it; yields its URL and a client, once the
    router has indexed both caches."""
    with _publisher() as pub_x, _publisher() as pub_y:
        async with (
            serve(_upstream(pub_x, [ADAPTER], source, got_x, backend)) as x,
            serve(_upstream(pub_y, [], source, got_y, backend)) as y,
            aiohttp.ClientSession() as http,
        ):
            settings = MeshSettings(
                workers=(WorkerSpec(x.url, "x"), WorkerSpec(y.url, "y")), health_interval=0.2
            )
            async with serve(build_router_app(settings)) as front:
                pub_x.stored([1, 2, 3, 4], PROMPT, lora_name=ADAPTER)
                pub_x.flush()
                pub_y.stored([11, 12, 13, 14], PROMPT)
                pub_y.flush()
                rows: dict[str, Any] = {}
                for _ in range(250):
                    async with http.get(front.url + "/kvmesh/workers") as r:
                        rows = {row["worker_id"]: row for row in (await r.json())["workers"]}
                    if rows["x"]["indexed_blocks"] == rows["y"]["indexed_blocks"] == 4:
                        break
                    await asyncio.sleep(0.02)
                assert rows["x"]["indexed_blocks"] == rows["y"]["indexed_blocks"] == 4
                assert (rows["x"]["lora_adapters"], rows["y"]["lora_adapters"]) == ([ADAPTER], [])
                yield front.url, http


async def _ask(http: Any, url: str, model: str, headers: dict[str, str] | None = None) -> tuple[str, int]:
    """Which worker served a one-token completion of PROMPT at ``url``, and how many of its
    tokens the router predicted cached there."""
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": 1,
        "nvext": {"extra_fields": ["worker_id", "timing"]},
    }
    async with http.post(url, json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        nvext = (await r.json())["nvext"]
    return nvext["worker_id"]["decode_worker_id"], nvext["timing"]["cached_tokens_predicted"]


@pytest.mark.parametrize("source", ["info", "models"])
async def test_adapter_requests_hash_with_the_adapter_and_reach_its_workers(source: str) -> None:
    got_x: list[str] = []
    got_y: list[str] = []
    async with _two_caches(source, got_x, got_y) as (front, http):
        # the adapter's prompt matches the adapter-salted blocks on x, not y's base blocks
        assert await _ask(http, front + "/v1/completions", ADAPTER) == ("x", 64)
        assert await _ask(http, front + "/v1/completions", BASE) == ("y", 64)
    assert (got_x, got_y) == ([ADAPTER], [BASE])


async def test_a_sagemaker_adapter_header_routes_an_invocation_as_the_adapters_request() -> None:
    """The body names the base model and SageMaker's header the adapter: vLLM serves the adapter,
    so the router routes on the adapter's blocks, to the worker serving it."""
    got_x: list[str] = []
    got_y: list[str] = []
    named = {ADAPTER_HEADER.decode().title(): ADAPTER}
    async with _two_caches("models", got_x, got_y) as (front, http):
        assert await _ask(http, front + "/invocations", BASE, named) == ("x", 64)
        # no header: the base model serves it, whatever the body names (vLLM writes null there)
        assert await _ask(http, front + "/invocations", BASE) == ("y", 64)
        assert await _ask(http, front + "/invocations", ADAPTER) == ("y", 64)
        # the header counts on /invocations alone, as vLLM reads it there alone
        assert await _ask(http, front + "/v1/completions", BASE, named) == ("y", 64)
    assert (got_x, got_y) == ([ADAPTER], [BASE, BASE, BASE])


async def test_a_failover_keeps_an_adapters_request_to_the_workers_serving_the_adapter() -> None:
    """x serves the adapter and dies after the router saw it up; y serves only the base model. The
    request must not fail over to y (which would answer it with an adapter it does not have)."""
    got_x: list[str] = []
    got_y: list[str] = []
    with _publisher() as pub_x, _publisher() as pub_y:
        async with serve(_upstream(pub_y, [], "info", got_y)) as y, aiohttp.ClientSession() as http:
            x_cm = serve(_upstream(pub_x, [ADAPTER], "info", got_x))
            x = await x_cm.__aenter__()
            settings = MeshSettings(
                workers=(WorkerSpec(x.url, "x"), WorkerSpec(y.url, "y")), health_interval=60.0
            )
            async with serve(build_router_app(settings)) as front:
                async with http.get(front.url + "/kvmesh/workers") as r:
                    rows = {row["worker_id"]: row for row in (await r.json())["workers"]}
                assert rows["x"]["state"] == rows["y"]["state"] == "up"
                x.crash()
                await x_cm.__aexit__(None, None, None)
                body = {"model": ADAPTER, "prompt": PROMPT, "max_tokens": 1}
                async with http.post(front.url + "/v1/completions", json=body) as r:
                    status = r.status
                base = {**body, "model": BASE}
                async with http.post(front.url + "/v1/completions", json=base) as r:
                    assert r.status == 200  # (y serves the base model all the same)
    assert status == 503
    assert (got_x, got_y) == ([], [BASE])


async def test_in_front_of_sglang_an_invocation_names_its_adapter_in_its_model() -> None:
    """SGLang's /invocations is its chat route: it reads the body's model, and not SageMaker's
    header. In front of SGLang workers alone, so does the router."""
    got_x: list[str] = []
    got_y: list[str] = []
    named = {ADAPTER_HEADER.decode().title(): ADAPTER}
    async with _two_caches("models", got_x, got_y, backend="sglang") as (front, http):
        assert await _ask(http, front + "/invocations", ADAPTER) == ("x", 64)
        assert await _ask(http, front + "/invocations", BASE, named) == ("y", 64)
    assert (got_x, got_y) == ([ADAPTER], [BASE])
