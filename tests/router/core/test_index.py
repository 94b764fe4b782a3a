"""Every prefix index behind ``KvIndex``: the contract suite over each variant, predict-on-route's
merge, the factory's choice, and the feeds a variant ignores."""

from __future__ import annotations

import random

import pytest

from kvmesh.errors import ConfigError
from kvmesh.events.wire import AllBlocksCleared, BlockRemoved, BlockStored
from kvmesh.hashing import block_hashes
from kvmesh.router.core.approx_index import ApproxIndex
from kvmesh.router.core.chain_trie import TierDepths
from kvmesh.router.core.config import RouterConfig
from kvmesh.router.core.event_index import PrefixIndex
from kvmesh.router.core.index import IndexCounters
from kvmesh.router.core.index_factory import index_for
from kvmesh.router.core.predicted_index import PredictedIndex

B = 4


def tokens(seed: int, n_blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n_blocks * B)]


# ---------------------------------------------------------------------- contract suite
class EventVariant:
    def __init__(self) -> None:
        self.index = PrefixIndex(block_size=B)
        self._next = 0

    def insert(self, worker: tuple[str, int], toks: list[int]) -> None:
        n = len(toks) // B
        ehs = list(range(self._next, self._next + n))
        self._next += n
        self.index.apply(worker, [BlockStored(ehs, None, toks, B)])

    def find(self, hashes: list[int]) -> dict[tuple[str, int], int]:
        return self.index.find_matches(hashes)


class ApproxVariant:
    def __init__(self, ttl: float) -> None:
        self.index = ApproxIndex(ttl=ttl)

    def insert(self, worker: tuple[str, int], toks: list[int]) -> None:
        self.index.record(worker, block_hashes(toks, B), now=0.0)

    def find(self, hashes: list[int]) -> dict[tuple[str, int], int]:
        return self.index.find_matches(hashes)


class PredictedVariant:
    """Events plus predict-on-route, fed either way: the contract holds for both feeds."""

    def __init__(self, feed: str) -> None:
        self.index = PredictedIndex(PrefixIndex(block_size=B), ApproxIndex(ttl=5.0))
        self._feed = EventVariant() if feed == "events" else ApproxVariant(5.0)
        self._feed.index = self.index  # type: ignore[assignment]

    def insert(self, worker: tuple[str, int], toks: list[int]) -> None:
        self._feed.insert(worker, toks)

    def find(self, hashes: list[int]) -> dict[tuple[str, int], int]:
        return self.index.find_matches(hashes)


VARIANTS = [
    pytest.param(EventVariant, id="events"),
    pytest.param(lambda: ApproxVariant(120.0), id="approx"),
    pytest.param(lambda: ApproxVariant(5.0), id="predicted"),
    pytest.param(lambda: PredictedVariant("events"), id="events+predicted/events"),
    pytest.param(lambda: PredictedVariant("decisions"), id="events+predicted/decisions"),
]


@pytest.mark.parametrize("make", VARIANTS)
class TestIndexContract:
    def test_empty_index_matches_nothing(self, make) -> None:
        assert make().find(block_hashes(tokens(1, 4), B)) == {}

    def test_longest_consecutive_prefix_per_worker(self, make) -> None:
        v = make()
        base = tokens(1, 40)
        v.insert(("a", 0), base[: 40 * B])
        v.insert(("b", 0), base[: 17 * B])
        v.insert(("b", 1), base[: 3 * B] + tokens(2, 5))
        query = block_hashes(base[: 33 * B] + tokens(3, 2), B)
        assert v.find(query) == {("a", 0): 33, ("b", 0): 17, ("b", 1): 3}

    def test_a_different_first_block_matches_nothing(self, make) -> None:
        v = make()
        v.insert(("a", 0), tokens(1, 8))
        assert v.find(block_hashes(tokens(9, 8), B)) == {}

    def test_same_blocks_at_another_position_do_not_alias(self, make) -> None:
        v = make()
        first, second = tokens(1, 1), tokens(2, 1)
        v.insert(("a", 0), first + second)
        assert v.find(block_hashes(second + first, B)) == {}

    def test_removed_worker_is_gone(self, make) -> None:
        v = make()
        v.insert(("a", 0), tokens(1, 5))
        v.insert(("b", 0), tokens(1, 5))
        v.index.remove_worker(("a", 0))
        assert v.find(block_hashes(tokens(1, 5), B)) == {("b", 0): 5}

    def test_a_flush_forgets_the_predictions_of_that_worker_only(self, make) -> None:
        """What routing predicted goes; what events said stays until the flush's own event."""
        v = make()
        v.insert(("a", 0), tokens(1, 5))
        v.insert(("b", 0), tokens(1, 5))
        v.index.forget_predicted(("a", 0))
        fed_by_events = isinstance(v, EventVariant) or getattr(v, "_feed", None).__class__ is EventVariant
        left = {("a", 0): 5, ("b", 0): 5} if fed_by_events else {("b", 0): 5}
        assert v.find(block_hashes(tokens(1, 5), B)) == left

    def test_query_longer_than_any_chunk_run(self, make) -> None:
        v = make()
        v.insert(("a", 0), tokens(4, 100))
        query = block_hashes(tokens(4, 100), B)
        for depth in (1, 15, 16, 17, 31, 32, 33, 99, 100):
            assert v.find(query[:depth]) == {("a", 0): depth}


# ---------------------------------------------------------------------- what follows a prefix
def test_the_blocks_that_follow_a_prefix_one_way_only() -> None:
    # a prompt stored as a prefill, its answer stored block by block under it as a decode goes on
    index = PrefixIndex(block_size=B)
    a, b = ("a", 0), ("b", 0)
    prompt, answer = tokens(1, 10), tokens(2, 4)
    index.apply(a, [BlockStored(list(range(10)), None, prompt, B)])
    for i in range(4):
        index.apply(a, [BlockStored([10 + i], 9 + i, answer[i * B : (i + 1) * B], B)])
    p = block_hashes(prompt, B)
    follow = block_hashes(prompt + answer, B)[10:]
    assert index.continuation(p, 10) == follow
    assert index.continuation(p, 2) == follow[:2]
    assert index.continuation(p[:4], 3) == p[4:7]
    assert index.continuation(p[:4], 0) == []
    # a query the trie does not hold whole is followed by nothing
    assert index.continuation(p[:4] + block_hashes(tokens(9, 1), B), 5) == []
    assert index.continuation(block_hashes(tokens(9, 2), B), 5) == []
    assert index.continuation([], 5) == []
    # a second answer to the same prompt (elsewhere): a fork, which the blocks stop at
    index.apply(b, [BlockStored(list(range(20, 30)), None, prompt, B)])
    index.apply(b, [BlockStored([30, 31], 29, tokens(3, 2), B)])
    assert index.continuation(p, 10) == []
    assert index.continuation(p[:4], 20) == p[4:]
    # past a fork on one way: the blocks of that way go on
    assert index.continuation(p + follow[:1], 10) == follow[1:]


def test_what_follows_a_prefix_is_what_the_engines_reported() -> None:
    index = PredictedIndex(PrefixIndex(block_size=B), ApproxIndex(ttl=5.0))
    toks = tokens(4, 6)
    hashes = block_hashes(toks, B)
    index.record(("a", 0), hashes, now=0.0)  # a decision's prediction is its own prompt, no more
    assert index.continuation(hashes[:2], 4) == []
    index.apply(("b", 0), [BlockStored([1, 2, 3, 4, 5, 6], None, toks, B)])
    assert index.continuation(hashes[:2], 4) == hashes[2:]


# ---------------------------------------------------------------------- predict-on-route
def test_a_prediction_longer_than_the_event_prefix_counts_as_device_at_every_level() -> None:
    index = PredictedIndex(PrefixIndex(block_size=B), ApproxIndex(ttl=5.0))
    toks = tokens(1, 6)
    hashes = block_hashes(toks, B)
    a, b = ("a", 0), ("b", 0)
    # a: 2 blocks on device, 4 on host (events); 3 predicted -> device 3, host stays 4
    index.apply(a, [BlockStored([1, 2], None, toks[: 2 * B], B)])
    index.apply(a, [BlockStored([3, 4], 2, toks[2 * B : 4 * B], B, medium="CPU")])
    index.record(a, hashes[:3], now=0.0)
    # b: 5 on disk (events), 1 predicted: shorter than nothing on device -> device 1, disk 5
    index.apply(b, [BlockStored([5, 6, 7, 8, 9], None, toks[: 5 * B], B, medium="DISK")])
    index.record(b, hashes[:1], now=0.0)
    # c: predicted only
    index.record(("c", 0), hashes, now=0.0)
    assert index.find_matches_tiered(hashes) == {
        a: TierDepths(3, 4, 4),
        b: TierDepths(1, 1, 5),
        ("c", 0): TierDepths(6, 6, 6),
    }
    assert index.find_matches(hashes) == {a: 3, b: 1, ("c", 0): 6}
    # the tie-break counts reported blocks only; expiry ends the predictions
    assert (index.block_count(a), index.block_count(("c", 0))) == (4, 0)
    assert index.expire(5.0) == 3 + 1 + 6
    assert index.find_matches(hashes) == {a: 2}


def test_a_stream_reset_keeps_the_predictions_and_removing_the_worker_drops_both() -> None:
    index = PredictedIndex(PrefixIndex(block_size=B), ApproxIndex(ttl=5.0))
    toks = tokens(2, 4)
    hashes = block_hashes(toks, B)
    a = ("a", 0)
    index.apply(a, [BlockStored([1, 2, 3, 4], None, toks, B)])
    index.record(a, hashes[:2], now=0.0)
    index.clear_worker(a)
    assert index.find_matches(hashes) == {a: 2}
    index.load_stored(a, [BlockStored([1, 2, 3], None, toks[: 3 * B], B)])
    assert index.find_matches(hashes) == {a: 3}
    index.remove_worker(a)
    assert index.find_matches(hashes) == {}


def test_counters_split_event_prunes_from_prediction_prunes() -> None:
    index = PredictedIndex(PrefixIndex(block_size=B), ApproxIndex(ttl=5.0, max_blocks=4))
    a = ("a", 0)
    index.apply(a, [BlockStored([1], None, tokens(1, 1), B), BlockRemoved([9])])
    index.record(a, block_hashes(tokens(2, 5), B), now=0.0)  # 5 > 4 -> prune to 3
    expected = IndexCounters({("stored", "ok"): 1, ("removed", "block_not_found"): 1}, 0, 2)
    assert index.counters() == expected
    assert index.counters() == expected  # reading does not add up


# ---------------------------------------------------------------------- one feed each
def test_the_approximate_index_ignores_kv_events() -> None:
    index = ApproxIndex(ttl=5.0)
    toks = tokens(3, 3)
    a = ("a", 0)
    index.record(a, block_hashes(toks, B), now=0.0)
    index.apply(a, [AllBlocksCleared(), BlockStored([1], None, tokens(4, 1), B)])
    index.load_stored(a, [BlockStored([2], None, tokens(5, 1), B)])
    index.clear_worker(a)
    assert index.find_matches(block_hashes(toks, B)) == {a: 3}
    assert index.find_matches(block_hashes(tokens(4, 1), B)) == {}
    assert index.counters() == IndexCounters({}, 0, 0)


def test_the_event_index_ignores_routing_decisions() -> None:
    index = PrefixIndex(block_size=B)
    toks = tokens(3, 3)
    a = ("a", 0)
    index.record(a, block_hashes(toks, B), now=0.0)
    assert index.find_matches(block_hashes(toks, B)) == {}
    index.apply(a, [BlockStored([1, 2, 3], None, toks, B)])
    assert index.expire(1e9) == 0
    assert index.find_matches(block_hashes(toks, B)) == {a: 3}


# ---------------------------------------------------------------------- factory
def test_the_config_chooses_the_index() -> None:
    events = index_for(RouterConfig(router_index_max_blocks=1000))
    assert isinstance(events, PrefixIndex) and events.max_entries == 1000
    approx = index_for(
        RouterConfig(
            use_kv_events=False, router_ttl_secs=7.0, router_max_tree_size=50, router_prune_target_ratio=0.5
        )
    )
    assert isinstance(approx, ApproxIndex)
    assert (approx.ttl, approx.max_blocks, approx.prune_target_ratio) == (7.0, 50, 0.5)
    both = index_for(RouterConfig(router_predicted_ttl_secs=3.0, router_max_tree_size=50))
    assert isinstance(both, PredictedIndex)
    assert (both.predicted.ttl, both.predicted.max_blocks) == (3.0, 50)
    # predictions only make sense beside events: without events the approximate index already is
    # one, so the combination is refused rather than accepted and ignored
    with pytest.raises(ConfigError, match="--router-predicted-ttl-secs needs KV events"):
        RouterConfig(use_kv_events=False, router_predicted_ttl_secs=3.0)
