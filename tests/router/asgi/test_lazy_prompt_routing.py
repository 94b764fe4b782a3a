"""A long prompt no worker holds is routed on its first chunk and hashed whole once the worker has
it: through a router in front of two simulated engines on loopback."""

from __future__ import annotations

import asyncio

import aiohttp

from kvmesh.mock.testing import run_mock
from kvmesh.router.asgi.standalone import build_router_app
from kvmesh.router.mesh.settings import MeshSettings, WorkerSpec
from tests.router.servers import serve

TOKEN = {"x-kvmesh-admin-token": "s3cret"}
BLOCK = 16


async def test_a_fresh_long_prompt_is_sent_before_it_is_hashed_whole_and_its_sibling_finds_it() -> None:
    async with (
        run_mock(block_size=BLOCK, speedup=20.0) as m0,
        run_mock(block_size=BLOCK, speedup=20.0, seed=1) as m1,
        aiohttp.ClientSession() as http,
    ):
        settings = MeshSettings(
            workers=(WorkerSpec(m0.base_url, "m0"), WorkerSpec(m1.base_url, "m1")), admin_token="s3cret"
        )
        app = build_router_app(settings)
        async with serve(app) as front:
            router = app.mesh.router
            flushed_with_work: list[bool] = []
            flush = router.flush

            def spy() -> None:
                flushed_with_work.append(router._deferred is not None)
                flush()

            router.flush = spy  # type: ignore[method-assign]
            # ~1,600 tokens nobody has seen: four chunks and more
            body = {
                "model": m0.config.model,
                "messages": [{"role": "user", "content": "a report nobody has read yet " * 250}],
                "max_tokens": 2,
            }

            async def post() -> tuple[str, int]:
                async with http.post(front.url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    doc = await r.json()
                    return r.headers["x-kvmesh-worker-id"], doc["usage"]["prompt_tokens"]

            (first_worker, tokens), (second_worker, tokens_again) = await asyncio.gather(post(), post())
            assert tokens == tokens_again > 4 * 16 * BLOCK
            assert True in flushed_with_work  # the first was placed before it was hashed whole
            async with http.get(front.url + "/kvmesh/decisions?limit=2", headers=TOKEN) as r:
                decisions = (await r.json())["decisions"]
            first, second = decisions[1], decisions[0]
            assert [c["overlap_blocks"] for c in first["candidates"]] == [0, 0]
            # the second saw every full block of the first on its worker, committed with the real
            # hashes (the engine's own events come only after its prefill)
            held = {c["worker_id"]: c["overlap_blocks"] for c in second["candidates"]}
            assert held[first["worker_id"]] == tokens // BLOCK
            assert {first_worker, second_worker} <= {"m0", "m1"}
