"""KV-event stream faults between a real mock engine and the standalone router: messages dropped,
duplicated, reordered and garbled, the stream cut while HTTP answers, an engine restarted with an
empty cache. After each, the router's index equals the engine's cache again, and the fault shows
in ``/kvmesh/workers``, ``/metrics`` and a warning in the log."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable

import pytest

from tests.events.eventkit import Frames
from tests.faults.rig import Engine, Rig, rig, until


def _dup(seq: int, frames: Frames) -> list[Frames]:
    return [frames, frames] if seq % 3 == 1 else [frames]


def _garble(seq: int, frames: Frames) -> list[Frames]:
    return [[frames[0], frames[1], b"\xc1 not msgpack"]] if seq % 4 == 2 else [frames]


def _reorder() -> Callable[[int, Frames], list[Frames]]:
    held: list[Frames] = []

    def swap(seq: int, frames: Frames) -> list[Frames]:
        if seq % 4 == 1 and not held:
            held.append(frames)
            return []
        out = [frames, *held]
        held.clear()
        return out

    return swap


FAULTS = [
    pytest.param("drop", "gap", id="dropped"),
    pytest.param("dup", "duplicate", id="duplicated"),
    pytest.param("reorder", "gap", id="reordered"),
    pytest.param("garble", "malformed", id="garbled"),
]


_sent = itertools.count()


async def _traffic(r: Rig, n: int, tag: str) -> None:
    """``n`` requests with prompts never sent before: each makes the engine store new blocks."""
    for _ in range(n):
        status, text = await r.chat(f"{tag} prompt {next(_sent)} " + "lorem ipsum dolor sit amet " * 8)
        assert status == 200, text


@pytest.mark.parametrize(("fault", "counter"), FAULTS)
async def test_a_stream_fault_is_repaired_and_visible(
    fault: str, counter: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvmesh")
    async with rig(1) as r:
        relay = r.relays[0]
        if fault == "drop":
            relay.drop = lambda seq: seq % 5 == 2
        elif fault == "dup":
            relay.transform = _dup
        elif fault == "reorder":
            relay.transform = _reorder()
        else:
            relay.transform = _garble
        await _traffic(r, 12, fault)
        await until(lambda: r.index_matches(0))
        url = r.engines[0].url

        async def counted() -> bool:
            return (await r.workers())[url]["events"].get(counter, 0) > 0

        await until(counted)
        metric = f'kvmesh_kv_event_faults_total{{fault="{counter}",worker="{url}"}}'
        await until(lambda: _has_metric(r, metric))
        if counter != "duplicate":  # a skipped duplicate needs no repair, so no warning
            assert any("KV-event stream repaired" in m for m in caplog.messages)
        assert (await r.workers())[url]["events"]["state"] == "live"
        assert await r.load() == 0


async def _has_metric(r: Rig, line: str) -> bool:
    text = await r.metrics()
    return any(row.startswith(line) and float(row.split()[-1]) > 0 for row in text.splitlines())


async def test_an_event_path_dead_while_http_answers_is_marked_stale_then_recovers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="kvmesh")
    async with rig(1) as r:
        url = r.engines[0].url
        await _traffic(r, 2, "before")
        await until(lambda: r.index_matches(0))
        r.relays[0].drop = lambda seq: True  # the event path dies; HTTP keeps answering

        async def stale() -> bool:
            await _traffic(r, 1, "during")
            return (await r.workers())[url]["events"]["state"] == "stale"

        await until(stale, timeout=15)
        assert any("index marked stale" in m for m in caplog.messages)
        assert await _has_metric(r, f'kvmesh_kv_event_faults_total{{fault="stale",worker="{url}"}}')
        await until(lambda: r.index_matches(0))  # re-synced from kv_state, repaired by replay
        r.relays[0].drop = lambda seq: False

        async def live() -> bool:
            await _traffic(r, 1, "after")
            return (await r.workers())[url]["events"]["state"] == "live"

        await until(live, timeout=15)
        await until(lambda: r.index_matches(0))
        assert await r.load() == 0


async def test_an_engine_restarted_with_an_empty_cache_is_reindexed(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvmesh")
    async with rig(1) as r:
        url = r.engines[0].url
        await _traffic(r, 4, "before")
        await until(lambda: r.index_matches(0))
        assert (await r.workers())[url]["indexed_blocks"] > 0
        await r.engines[0].crash()
        fresh: Engine = await r.engines[0].restart()
        r.engines[0] = fresh
        try:
            await until(lambda: r.index_matches(0), timeout=15)  # the old blocks are gone

            async def up() -> bool:
                return (await r.workers())[url]["state"] == "up"

            await until(up, timeout=15)
            await _traffic(r, 3, "after")
            await until(lambda: r.index_matches(0), timeout=15)
            assert (await r.workers())[url]["indexed_blocks"] > 0
            assert await r.load() == 0
        finally:
            await fresh.stack.aclose()


def test_the_fault_names_a_removed_worker_forgets_are_the_ones_counted() -> None:
    """``Metrics.forget_worker`` drops a removed worker's series by their label values: a fault
    name counted but not listed would stay exported for ever."""
    from kvmesh.router.mesh import event_feed
    from kvmesh.router.mesh.metrics import EVENT_FAULTS

    assert set(EVENT_FAULTS) == {*event_feed._FAULTS, "stale"}
