"""Two worker ids that make one NATS key, against a real nats-server: the second waits for the
first's entry to go instead of overwriting it at every renewal."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvmesh.events.nats_discovery import WorkerAnnouncer, WorkerWatcher
from kvmesh.events.nats_link import NatsLink, NatsOptions, subject_token
from tests.events.natskit import nats_server


@pytest.fixture
async def link() -> AsyncIterator[NatsLink]:
    with nats_server() as node:
        lk = NatsLink(NatsOptions((node.url,)), name="test")
        lk.start()
        assert await lk.wait_connected(10)
        yield lk
        await lk.close()


async def _until(check: Any, what: str, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"never: {what}")


async def test_a_worker_whose_id_makes_a_held_key_waits_and_says_so(
    link: NatsLink, caplog: pytest.LogCaptureFixture
) -> None:
    assert subject_token("gpu.0") == subject_token("gpu_0")
    seen: list[str] = []
    gone: list[str] = []

    async def on_seen(doc: dict[str, Any]) -> None:
        seen.append(doc["id"])

    async def on_gone(worker_id: str) -> None:
        gone.append(worker_id)

    watcher = WorkerWatcher(link, on_seen, on_gone, default_ttl=6.0)
    first = WorkerAnnouncer(link, "gpu.0", "http://10.0.0.1:8000", dict, interval=0.1, ttl=6.0)
    second = WorkerAnnouncer(link, "gpu_0", "http://10.0.0.2:8000", dict, interval=0.1, ttl=6.0)
    watcher.start()
    first.start()
    try:
        await _until(lambda: first.puts >= 2, "the first worker registers")
        with caplog.at_level(logging.ERROR, logger="kvmesh.events"):
            second.start()
            await _until(lambda: second.held_by == "gpu.0", "the second finds its key held")
            await asyncio.sleep(0.5)  # five renewals of each
        # Before, each renewal overwrote the other's entry, and the watcher saw both ids in turn.
        assert second.puts == 0
        assert set(seen) == {"gpu.0"}
        said = [r.getMessage() for r in caplog.records if "is not registered" in r.getMessage()]
        assert len(said) == 1 and "'gpu_0'" in said[0] and "'gpu.0'" in said[0]

        # The second stopping deletes nothing: the entry is the first's.
        await second.stop()
        kv = await link.js.key_value("kvmesh_workers")
        entry = await kv.get(subject_token("gpu.0"))
        assert json.loads(entry.value)["id"] == "gpu.0"

        # Once the first stops (its entry deleted), a worker of the other id registers.
        await first.stop()
        await _until(lambda: gone == ["gpu.0"], "the first worker leaves")
        third = WorkerAnnouncer(link, "gpu_0", "http://10.0.0.2:8000", dict, interval=0.1, ttl=6.0)
        third.start()
        await _until(lambda: seen[-1:] == ["gpu_0"], "the other id registers once the key is free")
        await third.stop()
    finally:
        await first.stop()
        await second.stop()
        await watcher.stop()
