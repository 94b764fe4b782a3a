"""A standalone router in front of test engines, all on loopback, a chat body builder, a wait
for a worker's blocks to reach the router's index, and a mock engine's count of finished requests."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from kvmesh.router.asgi.standalone import build_router_app
from kvmesh.router.core.config import RouterConfig
from kvmesh.router.mesh.settings import MeshSettings, WorkerSpec
from tests.router.engines import EngineState, engine_app
from tests.router.servers import Server, serve


@contextlib.asynccontextmanager
async def fleet(
    n: int = 2,
    *,
    router: RouterConfig | None = None,
    engine_kwargs: dict[str, Any] | None = None,
    **settings: Any,
) -> AsyncIterator[tuple[Server, list[EngineState], list[Server]]]:
    """``n`` test engines and a standalone router (approximate KV mode: no events needed)."""
    states = [EngineState(name=f"e{i}", **(engine_kwargs or {})) for i in range(n)]
    async with contextlib.AsyncExitStack() as stack:
        engines = [await stack.enter_async_context(serve(engine_app(s))) for s in states]
        config = router or RouterConfig(use_kv_events=False)
        mesh = MeshSettings(
            workers=tuple(WorkerSpec(e.url, e.url) for e in engines),
            router=config,
            health_interval=settings.pop("health_interval", 0.2),
            health_failures=1,
            **settings,
        )
        app = build_router_app(mesh)
        front = await stack.enter_async_context(serve(app))
        yield front, states, engines


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": "test-model", "messages": [{"role": "user", "content": text}], **extra}


async def indexed(
    http: aiohttp.ClientSession,
    url: str,
    worker: str,
    blocks: int,
    headers: dict[str, str] | None = None,
    tries: int = 500,
) -> None:
    """Wait until the router at ``url`` indexes ``blocks`` blocks of ``worker`` (its
    ``/kvmesh/workers``, every 20 ms, ``tries`` times; ``headers``: the admin token where one is
    set)."""
    for _ in range(tries):
        async with http.get(url + "/kvmesh/workers", headers=headers) as r:
            rows = {row["worker_id"]: row for row in (await r.json())["workers"]}
        if rows[worker]["indexed_blocks"] >= blocks:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{worker} never indexed {blocks} blocks")


def mock_finished(engine: Any) -> float:
    """Requests a mock engine (``kvmesh.mock.engine.MockEngine``) finished, by its own
    ``vllm:request_success`` counter: what it served, whoever sent it."""
    return sum(
        sample.value
        for family in engine.metrics.registry.collect()
        if family.name == "vllm:request_success"
        for sample in family.samples
        if sample.name.endswith("_total")
    )
