"""A KV-event batch lost right before a quiet period is found and repaired by the health checks.

No later batch reveals such a gap, so the registry asks after each quiet spell: a replay from
the next sequence when the worker has a replay socket, else its kv_state sequence (and a cold
start when it is ahead)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from kvmesh.mock.testing import run_mock
from kvmesh.router.asgi.standalone import build_router_app
from kvmesh.router.mesh.settings import MeshSettings, WorkerSpec
from tests.events.eventkit import LossyRelay
from tests.router.servers import serve


async def _until(check: Callable[[], Awaitable[bool]], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("replay", [True, False], ids=["replay", "kv_state"])
async def test_a_dropped_final_batch_is_repaired_after_the_quiet_period(replay: bool) -> None:
    async with run_mock(block_size=16, speedup=50.0) as mock, aiohttp.ClientSession() as http:
        assert mock.events_endpoint is not None
        losing = threading.Event()
        forwarder = LossyRelay(mock.events_endpoint, "tcp://127.0.0.1:*", drop=lambda _seq: losing.is_set())
        try:
            spec = WorkerSpec(
                mock.base_url,
                "m",
                kv_events_endpoints=(forwarder.endpoint,),
                kv_replay_endpoints=(mock.replay_endpoint if replay else None,),
            )
            settings = MeshSettings(workers=(spec,), health_interval=0.5)
            async with serve(build_router_app(settings)) as front:

                async def engine_blocks() -> int:
                    async with http.get(mock.base_url + "/kvmesh/kv_state") as r:
                        state = await r.json()
                    events = state["ranks"][0]["events"]
                    return sum(len(e["block_hashes"]) for e in events if e["type"] == "BlockStored")

                async def indexed_blocks() -> int:
                    async with http.get(front.url + "/kvmesh/workers") as r:
                        return int((await r.json())["workers"][0]["indexed_blocks"])

                async def in_step() -> bool:
                    return await indexed_blocks() == await engine_blocks() > 0

                async def ask(text: str) -> None:
                    body: dict[str, Any] = {
                        "model": mock.config.model,
                        "messages": [{"role": "user", "content": text * 20}],
                        "max_tokens": 2,
                    }
                    async with http.post(front.url + "/v1/chat/completions", json=body) as r:
                        assert r.status == 200

                await ask("the first prompt passes ")
                await _until(in_step)
                losing.set()
                await ask("the second prompt is lost on the way ")

                async def dropped() -> bool:
                    return bool(forwarder.dropped)

                await _until(dropped)
                losing.clear()
                # the loss is real, and no later batch will reveal it: the engine is idle now
                assert await indexed_blocks() < await engine_blocks()
                await _until(in_step)
        finally:
            forwarder.close()
