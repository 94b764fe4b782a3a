"""The latency cost prices tokens, not blocks: the same traffic on KV blocks of 8, 16, 32 or 64
tokens gets the same decisions and the same costs.

Engines differ in their block: vLLM defaults to 16 tokens, TensorRT-LLM to 32 or 64, SGLang pages
of any size. A term counted in blocks where it means tokens decides differently on each (stop 71
found one: chunks fixed at 16 blocks double-counted shared prefixes twice as many tokens on
32-token blocks). Here a small fleet replays a mix of chats and agent sessions whose every prompt,
answer and shared system prompt is a whole number of 64-token units, so every block size in the
test sees the same cached tokens; everything the router is told (arrivals, first tokens, reported
cached tokens, KV events, finishes) is the same in tokens and time. The decisions must then be
the same, candidate by candidate.
"""

from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass

import pytest

from kvmesh.events.wire import BlockStored, EventBatch
from kvmesh.hashing import block_hashes
from kvmesh.mock.timing import prefill_ms
from kvmesh.router.core.config import RouterConfig
from kvmesh.router.core.kv_router import Decision, KvRouter, RouteRequest

UNIT = 64  # every length below is a multiple of it, so each block size caches the same tokens
WORKERS = "abcd"
ITL_S = 0.015


@dataclass(frozen=True)
class Turn:
    prompt: list[int]
    answer: list[int]
    think_s: float


def traffic(seed: int, sessions: int = 24, turns: int = 5) -> list[tuple[float, list[Turn]]]:
    """Chats (a few units a turn) and agent sessions (tool outputs of 10-60 units a turn), four
    shared system prompts of 2-15 units, answers of 1-3 units, sessions starting over 3 s."""
    rng = random.Random(seed)

    def units(n: int) -> list[int]:
        return [rng.randrange(50_000) for _ in range(n * UNIT)]

    systems = [units(rng.randrange(2, 16)) for _ in range(4)]
    out = []
    for s in range(sessions):
        agent = s % 3 == 0
        start = rng.uniform(0.0, 3.0)
        context = list(systems[s % 4])
        session = []
        for _ in range(turns):
            context = context + units(rng.randrange(10, 60) if agent else rng.randrange(1, 4))
            answer = units(rng.randrange(1, 4))
            session.append(Turn(list(context), answer, rng.uniform(0.2, 1.5)))
            context = context + answer
        out.append((start, session))
    return out


class Replay:
    """One router on ``block_size``-token blocks in front of four engines that prefill one prompt
    at a time at the mock engine's curve, stream answers at a fixed pace and keep every whole unit
    they computed (the cache the router is told of, ``cache_tokens`` each, is smaller, so its
    eviction terms engage)."""

    def __init__(self, block_size: int, cache_tokens: int) -> None:
        self.bs = block_size
        self.router = KvRouter(RouterConfig(), random.Random(0))
        for w in WORKERS:
            self.router.add_worker(
                w, total_blocks=cache_tokens // block_size, max_num_batched_tokens=8192, block_size=block_size
            )
        self.cached: dict[str, set[int]] = {w: set() for w in WORKERS}
        self.engine_ids: dict[tuple[str, int], int] = {}
        self.busy_until = dict.fromkeys(WORKERS, 0.0)

    def run(self, sessions: list[tuple[float, list[Turn]]]) -> list[Decision]:
        decisions = []
        order = itertools.count()
        heap = [(start, next(order), "arrive", s, 0, "", 0) for s, (start, _) in enumerate(sessions)]
        heapq.heapify(heap)
        while heap:
            now, _, kind, s, t, worker, cached = heapq.heappop(heap)
            turn = sessions[s][1][t]
            rid = f"s{s}t{t}"
            if kind == "arrive":
                d = self.router.route(
                    RouteRequest(rid, block_hashes(turn.prompt, self.bs), len(turn.prompt)), now
                )
                assert isinstance(d, Decision), d
                decisions.append(d)
                worker = d.worker[0]
                cached = self._cached_tokens(worker, turn.prompt)
                start = max(now, self.busy_until[worker])
                first = start + (prefill_ms(len(turn.prompt) - cached) + 10.0) / 1000.0
                self.busy_until[worker] = first
                heapq.heappush(heap, (first, next(order), "first", s, t, worker, cached))
            elif kind == "first":
                self.router.first_token(rid, now)
                self.router.reported_cached(rid, cached)
                self._store(worker, turn.prompt, now)
                done = now + ITL_S * len(turn.answer) / 8
                heapq.heappush(heap, (done, next(order), "done", s, t, worker, cached))
            else:
                self.router.output_tokens(rid, len(turn.answer), now)
                self.router.finished(rid, now)
                self._store(worker, turn.prompt + turn.answer, now)
                if t + 1 < len(sessions[s][1]):
                    heapq.heappush(heap, (now + turn.think_s, next(order), "arrive", s, t + 1, "", 0))
        return decisions

    def _cached_tokens(self, worker: str, tokens: list[int]) -> int:
        held = self.cached[worker]
        n = 0
        for key in prefix_keys(tokens, UNIT):
            if key not in held:
                break
            n += UNIT
        return n

    def _store(self, worker: str, tokens: list[int], now: float) -> None:
        bs = self.bs
        ids = [
            self.engine_ids.setdefault((worker, k), len(self.engine_ids) + 1) for k in prefix_keys(tokens, bs)
        ]
        self.cached[worker].update(prefix_keys(tokens, UNIT))
        self.router.apply_events(
            worker, EventBatch(now, [BlockStored(ids, None, tokens[: len(ids) * bs], bs)], 0)
        )


def prefix_keys(tokens: list[int], size: int) -> list[int]:
    """One key per whole ``size``-token piece, standing for the prefix that ends with it."""
    keys, key = [], 0
    for end in range(size, len(tokens) + 1, size):
        key = hash((key, *tokens[end - size : end]))
        keys.append(key)
    return keys


def scores(d: Decision) -> list[tuple[str, float, float]]:
    return [(c.worker[0], c.cost, c.predicted_ttft_ms or 0.0) for c in d.breakdown]


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("cache_tokens", [16_384, 32_768])
def test_the_latency_cost_decides_the_same_on_every_block_size(seed: int, cache_tokens: int) -> None:
    sessions = traffic(seed)
    reference = Replay(16, cache_tokens).run(sessions)
    for block_size in (8, 32, 64):
        other = Replay(block_size, cache_tokens).run(sessions)
        assert [d.worker for d in other] == [d.worker for d in reference], block_size
        for a, b in zip(reference, other, strict=True):
            for (wa, ca, ta), (wb, cb, tb) in zip(scores(a), scores(b), strict=True):
                assert wa == wb
                assert cb == pytest.approx(ca, rel=1e-9, abs=1e-9), (block_size, a.request_id, wa)
                assert tb == pytest.approx(ta, rel=1e-9, abs=1e-9), (block_size, a.request_id, wa)


def test_the_replay_reaches_every_term_of_the_cost() -> None:
    """The traffic above is not an idle fleet: the waits, the effects on others, the evictions and
    the memory waits all price some of its candidates, so the test above compares them."""
    seen: set[str] = set()
    for d in Replay(16, 16_384).run(traffic(1)):
        for c in d.breakdown:
            for term in (
                "step_wait_ms",
                "delay_to_others_ms",
                "turns_overlap_ms",
                "eviction_ms",
                "memory_wait_ms",
            ):
                if getattr(c, term) > 0.0:
                    seen.add(term)
    assert seen == {"step_wait_ms", "delay_to_others_ms", "turns_overlap_ms", "eviction_ms", "memory_wait_ms"}
