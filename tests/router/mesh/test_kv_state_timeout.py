"""A worker's ``/kvmesh/kv_state`` lists every cached block (megabytes on a large cache), so it has
its own timeout: the connect timeout that bounds health checks and small RPCs must not cut a cold
start short."""

from __future__ import annotations

import asyncio

import aiohttp
import zmq
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvmesh.events.wire import BlockStored
from kvmesh.router.asgi.standalone import build_router_app
from kvmesh.router.mesh.settings import MeshSettings, WorkerSpec
from kvmesh.worker.block_state import kv_state_answer, rank_state
from tests.router.servers import serve

CONNECT_TIMEOUT = 0.5


def _worker(events_endpoint: str, kv_state_delay: float) -> tuple[Starlette, list[str]]:
    """A worker whose kv_state holds two cached blocks and answers only after ``kv_state_delay``."""
    served: list[str] = []
    stored = BlockStored(
        block_hashes=[11, 12], parent_block_hash=None, token_ids=list(range(32)), block_size=16
    )

    async def info(request: Request) -> Response:
        return JSONResponse(
            {
                "backend": "test",
                "model": "test-model",
                "block_size": 16,
                "dp_size": 1,
                "kv_events_endpoints": [events_endpoint],
                "kv_replay_endpoints": [None],
                "max_num_batched_tokens": 8192,
                "total_kv_blocks": 1000,
            }
        )

    async def kv_state(request: Request) -> Response:
        await asyncio.sleep(kv_state_delay)
        served.append("kv_state")
        return JSONResponse(kv_state_answer(16, [rank_state(0, None, [stored])]))

    async def ok(request: Request) -> Response:
        return JSONResponse({"status": "ok", "data": []})

    routes = [Route("/kvmesh/info", info), Route("/kvmesh/kv_state", kv_state)]
    return Starlette(routes=[*routes, Route("/health", ok), Route("/v1/models", ok)]), served


async def _indexed_blocks(http: aiohttp.ClientSession, front: str) -> int:
    async with http.get(front + "/kvmesh/workers") as r:
        return int((await r.json())["workers"][0]["indexed_blocks"])


async def test_a_kv_state_slower_than_the_connect_timeout_still_cold_starts_the_index(
    http: aiohttp.ClientSession,
) -> None:
    ctx = zmq.Context.instance()
    publisher = ctx.socket(zmq.PUB)  # the worker's event feed: quiet, the index comes from kv_state
    try:
        port = publisher.bind_to_random_port("tcp://127.0.0.1")
        app, served = _worker(f"tcp://127.0.0.1:{port}", kv_state_delay=3 * CONNECT_TIMEOUT)
        async with serve(app) as worker:
            settings = MeshSettings(
                workers=(WorkerSpec(worker.url, worker.url),),
                connect_timeout=CONNECT_TIMEOUT,
                kv_state_timeout=30.0,
            )
            async with serve(build_router_app(settings)) as front:
                for _ in range(500):
                    if served and await _indexed_blocks(http, front.url) == 2:
                        break
                    await asyncio.sleep(0.02)
                assert served, "the worker never answered kv_state"
                assert await _indexed_blocks(http, front.url) == 2
    finally:
        publisher.close(linger=0)
