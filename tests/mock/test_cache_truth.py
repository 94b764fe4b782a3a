"""Cache truth: what a kvmesh subscriber learns from the mock's events is exactly what the mock holds.

A random multi-request workload (shared prefixes, eviction, preemption, aborted clients) runs
against a live mock. Its events reach an ``EventSubscriber`` through a forwarder that drops some
batches, so the subscriber must recover them from the mock's replay socket. When the engine is
quiet, the index built from the events must equal ``/kvmesh/kv_state``; and every probe request's
``cached_tokens`` must equal the cached prefix that index shows for its prompt.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import httpx
import pytest

from kvmesh.events.subscriber import EventSubscriber
from kvmesh.events.wire import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvmesh.mock.testing import run_mock
from tests.events.eventkit import LossyRelay

pytestmark = pytest.mark.e2e

BS = 8


class Index:
    """Engine hash -> (parent hash, block tokens), built from events the way a router does."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[int | None, tuple[int, ...]]] = {}
        self.removed = 0

    def apply(self, seq: int, batch: EventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                parent = event.parent_block_hash
                for j, h in enumerate(event.block_hashes):
                    assert h not in self.blocks, f"batch {seq} stores {h} twice"
                    self.blocks[h] = (parent, tuple(event.token_ids[j * BS : (j + 1) * BS]))  # type: ignore[assignment,arg-type]
                    parent = h
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    assert h in self.blocks, f"batch {seq} removes unknown block {h}"
                    del self.blocks[h]  # type: ignore[arg-type]
                    self.removed += 1
            elif isinstance(event, AllBlocksCleared):
                self.blocks.clear()

    def cached_prefix_tokens(self, tokens: list[int]) -> int:
        """Tokens of ``tokens``' longest cached prefix, as the engine would reuse it (never the last token)."""
        lookup = {(parent, toks): h for h, (parent, toks) in self.blocks.items()}
        parent: int | None = None
        n = 0
        for k in range((len(tokens) - 1) // BS):
            h = lookup.get((parent, tuple(tokens[k * BS : (k + 1) * BS])))
            if h is None:
                break
            parent, n = h, n + 1
        return n * BS


def _snapshot(state: dict[str, Any]) -> dict[int, tuple[int | None, tuple[int, ...]]]:
    events = state["ranks"][0]["events"]
    return {e["block_hashes"][0]: (e["parent_block_hash"], tuple(e["token_ids"])) for e in events}


async def _settle(mock: Any, http: httpx.AsyncClient, subscriber: EventSubscriber) -> dict[str, Any]:
    """Wait until the engine is idle and the subscriber has applied everything; return kv_state."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 15
    while mock.engine.scheduler.has_work:
        assert loop.time() < deadline, "engine did not go idle"
        await asyncio.sleep(0.01)
    state = (await http.get("/kvmesh/kv_state")).json()
    last_seq = state["ranks"][0]["last_seq"]
    nudge = loop.time() + 0.3
    while subscriber.expected_seq != last_seq + 1:
        assert loop.time() < deadline, (
            f"subscriber stuck at {subscriber.expected_seq}, publisher at {last_seq}"
        )
        if loop.time() > nudge and subscriber.expected_seq is not None:
            # The newest batch itself was dropped: no later batch reveals the gap. A router that
            # sees kv_state's last_seq ahead of its stream asks the replay socket, as here.
            subscriber.resume_from(subscriber.expected_seq - 1)
            nudge = loop.time() + 0.3
        await asyncio.sleep(0.01)
    return state  # type: ignore[no-any-return]


async def test_events_describe_the_cache_exactly_and_cached_tokens_are_true() -> None:
    rng = random.Random(20240601)
    families = [[rng.randrange(300, 5000) for _ in range(64)] for _ in range(3)]
    index = Index()
    async with run_mock(
        block_size=BS, num_blocks=32, max_num_seqs=8, max_num_batched_tokens=48, speedup=20
    ) as mock:
        forwarder = LossyRelay(
            mock.events_endpoint, "tcp://127.0.0.1:*", drop=lambda seq: seq % 5 == 2 or 40 <= seq < 47
        )
        subscriber = EventSubscriber(
            forwarder.endpoint, index.apply, replay_endpoint=mock.replay_endpoint, name="mock"
        )
        subscriber.start()
        await asyncio.sleep(0.2)  # let both SUB sockets join before the first batch
        try:
            async with httpx.AsyncClient(base_url=mock.base_url, timeout=30) as http:

                async def one(i: int) -> None:
                    prompt = rng.choice(families)[: rng.randrange(BS, 65)] + [
                        rng.randrange(300, 5000) for _ in range(rng.randrange(13))
                    ]
                    body = {"prompt": prompt, "max_tokens": rng.randrange(1, 60), "stream": True}
                    async with http.stream("POST", "/v1/completions", json=body) as r:
                        assert r.status_code == 200
                        async for line in r.aiter_lines():
                            if i % 7 == 3:
                                return  # the client walks away mid-stream: the engine aborts it
                            if line == "data: [DONE]":
                                return

                gate = asyncio.Semaphore(12)

                async def gated(i: int) -> None:
                    async with gate:
                        await one(i)

                await asyncio.gather(*(gated(i) for i in range(90)))
                state = await _settle(mock, http, subscriber)
                assert index.blocks == _snapshot(state)

                # the workload did what it is meant to exercise
                assert mock.engine.scheduler.num_preemptions > 0
                assert index.removed > 0
                assert len(forwarder.dropped) >= 8 and subscriber.stats.replayed >= len(forwarder.dropped)
                assert subscriber.stats.unrecoverable == 0

                # Probes, one at a time: the engine must reuse exactly the prefix the index shows.
                probes = [
                    families[0][:64],
                    families[1][:37],
                    families[2][:20] + [7] * 30,
                    [9] * 40,
                    families[0][:64],
                ]
                hits = 0
                for prompt in probes:
                    expected = index.cached_prefix_tokens(prompt)
                    r = await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
                    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == expected, prompt
                    hits += expected > 0
                    state = await _settle(mock, http, subscriber)
                    assert index.blocks == _snapshot(state)
                assert hits >= 2  # at least the repeated probe and one family hit the cache
        finally:
            await subscriber.stop()
            forwarder.close()
