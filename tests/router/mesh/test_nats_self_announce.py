"""Engines embedding the middleware register themselves in the NATS worker bucket: two mock engines,
each wrapped by the router with its own URL and no --workers list, find each other, route to each
other, and a stopped one leaves the other's registry."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from starlette.middleware import Middleware

from kvmesh.events.nats_link import NatsOptions, import_nats, subject_token
from kvmesh.mock.testing import RunningMock, run_mock
from kvmesh.router.asgi.middleware import KvMeshMiddleware
from kvmesh.router.core.config import RouterConfig
from kvmesh.router.mesh.settings import MeshSettings
from tests.events.natskit import HOST, free_port, nats_server


@contextlib.asynccontextmanager
async def _embedded(nats_url: str) -> AsyncIterator[RunningMock]:
    """A mock engine (KV events on its own ZMQ sockets) with the middleware embedded on NATS."""
    port = free_port()
    settings = MeshSettings(
        self_url=f"http://{HOST}:{port}",
        event_plane=nats_url,
        nats_worker_ttl=1.5,
        health_interval=0.2,
        router=RouterConfig(router_temperature=0.0),
    )
    middleware = [Middleware(KvMeshMiddleware, settings=settings)]
    async with run_mock(block_size=16, speedup=50.0, port=port, middleware=middleware) as m:
        yield m


async def _workers(http: aiohttp.ClientSession, base: str) -> dict[str, dict[str, Any]]:
    async with http.get(base + "/kvmesh/workers") as r:
        return {row["url"]: row for row in (await r.json())["workers"]}


async def _until(check: Any, what: str, timeout: float = 15.0) -> None:
    for _ in range(int(timeout / 0.05)):
        if await check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"never: {what}")


async def _bucket_entry(nats_url: str, key: str) -> dict[str, Any]:
    nats = import_nats()
    nc = await nats.connect(servers=[nats_url])
    try:
        kv = await nc.jetstream().key_value(NatsOptions((nats_url,)).bucket)
        entry = await kv.get(subject_token(key))
        return dict(json.loads(entry.value))
    finally:
        await nc.close()


async def test_embedded_engines_register_and_find_each_other(http: aiohttp.ClientSession) -> None:
    with nats_server() as node:
        async with _embedded(node.url) as a:
            async with _embedded(node.url) as b:

                async def both_see_both() -> bool:
                    for m in (a, b):
                        rows = await _workers(http, m.base_url)
                        if not all(rows.get(x.base_url, {}).get("state") == "up" for x in (a, b)):
                            return False
                    return True

                await _until(both_see_both, "each embedded engine discovers the other through the bucket")

                # The entry carries the engine's own /kvmesh/info, read in-process.
                entry = await _bucket_entry(node.url, b.base_url)
                assert entry["id"] == entry["url"] == b.base_url
                assert entry["info"]["block_size"] == 16
                assert entry["info"]["kv_events_endpoints"] == [b.events_endpoint]
                async with http.get(a.base_url + "/kvmesh/router") as r:
                    assert (await r.json())["event_plane"]["discovered"] == [b.base_url]

                # Pinned to the discovered peer, a request sent to A is served by B.
                body = {
                    "model": a.config.model,
                    "messages": [{"role": "user", "content": "hello " * 20}],
                    "max_tokens": 2,
                    "nvext": {"backend_instance_id": b.base_url},
                }
                served_before = b.engine.steps
                async with http.post(a.base_url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                assert b.engine.steps > served_before
                b_url = b.base_url

            # B stopped cleanly: its entry is deleted and A drops it.
            async def b_gone() -> bool:
                return b_url not in await _workers(http, a.base_url)

            await _until(b_gone, "a stopped embedded engine leaves the other's registry")
