"""A router process of its own freezes its start-up heap once its workers are known.

``kvmesh router`` builds its app with ``freeze_heap=True``: after the first discovery, every object
alive (imports, app, registry, the workers' info) moves to the collector's permanent generation, so
no request pays a full collection that walks them. An app served beside others in one process (as
here, in the test run) leaves the collector alone unless asked.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator

import aiohttp
import pytest

from kvmesh.mock.testing import run_mock
from kvmesh.router.asgi.standalone import build_router_app
from kvmesh.router.mesh.settings import MeshSettings, WorkerSpec
from tests.router.servers import serve


@pytest.fixture
def thawed() -> Iterator[None]:
    """No frozen objects before the test, none left after it (the rest of the run collects as usual)."""
    gc.unfreeze()
    yield
    gc.unfreeze()


def collectable(obj: object) -> bool:
    """Whether the collector still visits ``obj`` (frozen objects are in no generation)."""
    return any(o is obj for o in gc.get_objects())


async def ask(http: aiohttp.ClientSession, url: str, model: str) -> None:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "why is the sky blue " * 20}],
        "max_tokens": 2,
    }
    async with http.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200


@pytest.mark.usefixtures("thawed")
async def test_the_start_up_heap_is_frozen_after_the_first_discovery() -> None:
    async with run_mock(block_size=16, speedup=50.0) as mock, aiohttp.ClientSession() as http:
        app = build_router_app(MeshSettings(workers=(WorkerSpec(mock.base_url, "m0"),)), freeze_heap=True)
        async with serve(app) as front:
            for _ in range(500):
                if gc.get_freeze_count():
                    break
                await asyncio.sleep(0.01)
            assert gc.get_freeze_count() > 1000
            worker = app.mesh.registry.get("m0")
            assert worker is not None and worker.info is not None
            # the worker's info came from the first discovery: the freeze waited for it
            assert not collectable(worker.info)
            assert not collectable(app.mesh.router)
            await ask(http, front.url, mock.config.model)  # requests are served as before
            later = [object()]  # and what is made afterwards is collected as usual
            assert collectable(later)


@pytest.mark.usefixtures("thawed")
async def test_an_app_served_beside_others_leaves_the_collector_alone() -> None:
    async with run_mock(block_size=16, speedup=50.0) as mock, aiohttp.ClientSession() as http:
        app = build_router_app(MeshSettings(workers=(WorkerSpec(mock.base_url, "m0"),)))
        async with serve(app) as front:
            await app.mesh.wait_ready()
            await ask(http, front.url, mock.config.model)
            assert gc.get_freeze_count() == 0
            assert collectable(app.mesh.router)
