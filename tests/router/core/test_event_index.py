"""Event index: brute-force model test of matching over KV events, dump/load, event edge cases."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh._types import Tier
from kvmesh.events.wire import AllBlocksCleared, BlockRemoved, BlockStored
from kvmesh.hashing import block_hashes
from kvmesh.router.core.chain_trie import TierDepths
from kvmesh.router.core.event_index import PrefixIndex

B = 4


def tokens(seed: int, n_blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n_blocks * B)]


# ---------------------------------------------------------------------- brute force model
WORKERS = [("a", 0), ("a", 1), ("b", 0)]
MEDIUMS = {Tier.DEVICE: "GPU", Tier.HOST: "CPU_PINNED", Tier.DISK: "DISK"}
LEVEL_TIERS = [(Tier.DEVICE,), (Tier.DEVICE, Tier.HOST), (Tier.DEVICE, Tier.HOST, Tier.DISK)]


def _stored(tiers: list[Tier]) -> st.SearchStrategy[tuple]:
    return st.tuples(
        st.just("store"),
        st.sampled_from(WORKERS),
        st.sampled_from(tiers),
        st.integers(0, 20),  # parent pick (index into the worker's known engine hashes, or root)
        st.lists(st.integers(0, 11), min_size=1, max_size=4),  # engine hashes (small: collisions)
        st.lists(st.integers(0, 2), min_size=B, max_size=4 * B),  # tokens from a tiny vocabulary
    )


def _removed(tiers: list[Tier]) -> st.SearchStrategy[tuple]:
    return st.tuples(
        st.just("remove"),
        st.sampled_from(WORKERS),
        st.sampled_from(tiers),
        st.lists(st.integers(0, 11), min_size=1, max_size=3),
    )


stored_op = _stored(list(MEDIUMS))
removed_op = _removed(list(MEDIUMS))
cleared_op = st.tuples(st.just("clear"), st.sampled_from(WORKERS))
again_op = st.tuples(st.just("again"), st.integers(0, 40))  # repeat an earlier store exactly


class Model:
    """Per worker and tier: engine hash -> full path of local hashes. Matching walks block by block."""

    def __init__(self) -> None:
        self.maps: dict[tuple[str, int], dict[Tier, dict[int, tuple[int, ...]]]] = {
            w: {t: {} for t in MEDIUMS} for w in WORKERS
        }
        # extra copies: the same engine hash stored again for the same block, removed one by one
        self.copies: dict[tuple[tuple[str, int], Tier, int], int] = {}

    def store(self, worker: tuple[str, int], tier: Tier, eh: int, path: tuple[int, ...]) -> None:
        key = (worker, tier, eh)
        if self.maps[worker][tier].get(eh) == path:
            self.copies[key] = self.copies.get(key, 0) + 1
        else:
            self.copies.pop(key, None)
            self.maps[worker][tier][eh] = path

    def remove(self, worker: tuple[str, int], tier: Tier, eh: int) -> None:
        key = (worker, tier, eh)
        if self.copies.get(key):
            self.copies[key] -= 1
        else:
            self.maps[worker][tier].pop(eh, None)

    def clear(self, worker: tuple[str, int]) -> None:
        for t in MEDIUMS:
            self.maps[worker][t].clear()
        self.copies = {k: n for k, n in self.copies.items() if k[0] != worker}

    def depth(self, worker: tuple[str, int], level: int, query: list[int]) -> int:
        held = set()
        for t in LEVEL_TIERS[level]:
            held |= set(self.maps[worker][t].values())
        d = 0
        while d < len(query) and tuple(query[: d + 1]) in held:
            d += 1
        return d


def run_ops(ops: list) -> tuple[PrefixIndex, Model]:
    index, model = PrefixIndex(block_size=B), Model()
    done: list[tuple] = []  # stores as applied, for "again"
    for op in ops:
        if op[0] == "again" and done:
            op = done[op[1] % len(done)]
        if op[0] == "store":
            _, w, tier, pick, ehs, toks = op
            if isinstance(pick, tuple):  # repeated: the parent it had then
                (parent,) = pick
            else:
                known = [eh for t in MEDIUMS for eh in model.maps[w][t]]
                parent = known[pick % len(known)] if known and pick < 15 else None
            n = min(len(ehs), len(toks) // B)
            ehs, toks = ehs[:n], toks[: n * B]
            if parent is not None and not any(parent in model.maps[w][t] for t in MEDIUMS):
                continue  # its parent is gone: the repeat would be parent_not_found
            done.append(("store", w, tier, (parent,), ehs, toks))
            index.apply(w, [BlockStored(ehs, parent, toks, B, medium=MEDIUMS[tier])])
            if parent is None:
                path: tuple[int, ...] = ()
            else:
                # the index resolves a parent hash device first, then host, then disk
                path = next(model.maps[w][t][parent] for t in MEDIUMS if parent in model.maps[w][t])
            for eh, h in zip(ehs, block_hashes(toks, B), strict=True):
                path = (*path, h)
                model.store(w, tier, eh, path)
        elif op[0] == "remove":
            _, w, tier, ehs = op
            index.apply(w, [BlockRemoved(ehs, medium=MEDIUMS[tier])])
            for eh in ehs:
                model.remove(w, tier, eh)
        elif op[0] == "clear":
            _, w = op
            index.apply(w, [AllBlocksCleared()])
            model.clear(w)
    return index, model


def queries(model: Model, rng: random.Random) -> list[list[int]]:
    paths = [list(p) for w in WORKERS for t in MEDIUMS for p in model.maps[w][t].values()]
    out = [[rng.getrandbits(64)]]
    for p in paths[:12]:
        out.append(p)
        out.append([*p, rng.getrandbits(64)])
        out.append(p[:-1])
    return out


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.one_of(stored_op, stored_op, removed_op, cleared_op, again_op), max_size=40),
    st.integers(0, 9),
)
def test_find_matches_equals_brute_force(ops: list, seed: int) -> None:
    index, model = run_ops(ops)
    for query in queries(model, random.Random(seed)):
        expected = {w: model.depth(w, 0, query) for w in WORKERS}
        assert index.find_matches(query) == {w: d for w, d in expected.items() if d}
        tiered = {w: TierDepths(*(model.depth(w, lv, query) for lv in range(3))) for w in WORKERS}
        assert index.find_matches_tiered(query) == {w: t for w, t in tiered.items() if t.disk}


# a fleet without offloading: every block on a device, which the tiered query takes a shortcut for
device_stored_op = _stored([Tier.DEVICE])
device_removed_op = _removed([Tier.DEVICE])


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(device_stored_op, device_stored_op, device_removed_op, cleared_op, again_op), max_size=40
    ),
    st.integers(0, 9),
)
def test_without_offloading_every_tier_matches_as_deep_as_the_device(ops: list, seed: int) -> None:
    index, model = run_ops(ops)
    for query in queries(model, random.Random(seed)):
        expected = {w: model.depth(w, 0, query) for w in WORKERS}
        assert index.find_matches_tiered(query) == {w: TierDepths(d, d, d) for w, d in expected.items() if d}


def test_a_block_stored_off_the_device_makes_the_tiers_differ() -> None:
    """The tiered query's shortcut for a fleet without offloading ends with the first block stored
    in host memory: its worker's host level reaches further than its device level from then on."""
    index = PrefixIndex(block_size=B)
    a = WORKERS[0]
    toks = list(range(3 * B))
    index.apply(a, [BlockStored([1, 2], None, toks[: 2 * B], B)])
    query = block_hashes(toks, B)
    assert index.find_matches_tiered(query) == {a: TierDepths(2, 2, 2)}
    index.apply(a, [BlockStored([3], 2, toks[2 * B :], B, medium="CPU_PINNED")])
    assert index.find_matches_tiered(query) == {a: TierDepths(2, 3, 3)}


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(stored_op, removed_op, cleared_op, again_op), max_size=30))
def test_dump_then_load_rebuilds_an_identical_index(ops: list) -> None:
    index, model = run_ops(ops)
    copy = PrefixIndex(block_size=B)
    copy.load(index.dump())
    assert copy.block_counts() == {w: n for w, n in index.block_counts().items() if n}
    for query in queries(model, random.Random(0)):
        assert copy.find_matches_tiered(query) == index.find_matches_tiered(query)
    # the rebuilt index keeps the engine-hash map: removals still apply
    for w in WORKERS:
        index.apply(w, [BlockRemoved(list(range(12)))])
        copy.apply(w, [BlockRemoved(list(range(12)))])
    for query in queries(model, random.Random(1)):
        assert copy.find_matches_tiered(query) == index.find_matches_tiered(query)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(stored_op, removed_op, cleared_op, again_op), max_size=30))
def test_removing_everything_frees_every_node(ops: list) -> None:
    index, _ = run_ops(ops)
    for w in WORKERS:
        index.apply(w, [AllBlocksCleared()])
    assert index.segment_count == 0
    assert index.total_entries == 0


# ---------------------------------------------------------------------- events in detail
def test_two_workers_with_different_engine_hashes_are_both_indexed() -> None:
    index = PrefixIndex(block_size=B)
    toks = tokens(1, 3)
    index.apply(("a", 0), [BlockStored([1, 2, 3], None, toks, B)])
    index.apply(("b", 0), [BlockStored([71, 72, 73], None, toks, B)])
    assert index.find_matches(block_hashes(toks, B)) == {("a", 0): 3, ("b", 0): 3}
    assert index.block_counts() == {("a", 0): 3, ("b", 0): 3}
    index.apply(("b", 0), [BlockRemoved([72])])
    assert index.find_matches(block_hashes(toks, B)) == {("a", 0): 3, ("b", 0): 1}


def test_a_child_stored_against_its_parent_hash_extends_the_chain() -> None:
    index = PrefixIndex(block_size=B)
    toks = tokens(2, 3)
    index.apply(("a", 0), [BlockStored([10], None, toks[:B], B)])
    index.apply(("a", 0), [BlockStored([11, 12], 10, toks[B:], B)])
    assert index.find_matches(block_hashes(toks, B)) == {("a", 0): 3}


def test_removing_a_middle_block_cuts_the_prefix_and_restoring_it_heals_it() -> None:
    index = PrefixIndex(block_size=B)
    toks = tokens(3, 40)
    index.apply(("a", 0), [BlockStored(list(range(40)), None, toks, B)])
    query = block_hashes(toks, B)
    index.apply(("a", 0), [BlockRemoved([5])])
    assert index.find_matches(query) == {("a", 0): 5}
    index.apply(("a", 0), [BlockStored([5], 4, toks[5 * B : 6 * B], B)])
    assert index.find_matches(query) == {("a", 0): 40}


def test_storing_a_known_run_at_another_tier_recomputes_every_block_of_it() -> None:
    # a holds b0 on disk and b1 on host; storing b1, b2 on device (blocks b's chain already built)
    # must give b2 disk-level reach even though b1's own reach does not change
    index = PrefixIndex(block_size=B)
    toks = tokens(6, 3)
    a = ("a", 0)
    index.apply(a, [BlockStored([1], None, toks[:B], B, medium="DISK")])
    index.apply(a, [BlockStored([2], 1, toks[B : 2 * B], B, medium="CPU")])
    index.apply(("b", 0), [BlockStored([9, 10, 11], None, toks, B)])
    index.apply(a, [BlockStored([12, 13], 1, toks[B:], B, medium="GPU")])
    assert index.find_matches_tiered(block_hashes(toks, B))[a] == TierDepths(0, 0, 3)


def test_runs_stored_one_after_another_extend_one_segment_and_branch_where_they_differ() -> None:
    index = PrefixIndex(block_size=B)
    toks = tokens(7, 6)
    w = ("a", 0)
    for i in range(6):  # a decode: one block per event, each under the previous one
        index.apply(w, [BlockStored([i], i - 1 if i else None, toks[i * B : (i + 1) * B], B)])
    assert index.segment_count == 1
    other = toks[: 3 * B] + tokens(8, 2)
    index.apply(("b", 0), [BlockStored([20, 21, 22, 23, 24], None, other, B)])
    assert index.segment_count == 2
    assert index.find_matches(block_hashes(toks, B)) == {w: 6, ("b", 0): 3}
    assert index.find_matches(block_hashes(other, B)) == {w: 3, ("b", 0): 5}
    index.apply(w, [BlockRemoved([3])])
    assert index.find_matches(block_hashes(toks, B)) == {w: 3, ("b", 0): 3}


def test_a_hash_stored_twice_stays_cached_until_both_copies_are_removed() -> None:
    # vLLM caches a second physical block under a hash it already caches (two requests computing
    # the same prefix in one step, or the recomputed last block of a fully cached prompt), sends
    # BlockStored for each and BlockRemoved for each copy it evicts: one removal leaves one copy.
    index = PrefixIndex(block_size=B)
    toks = tokens(10, 3)
    w = ("a", 0)
    query = block_hashes(toks, B)
    index.apply(w, [BlockStored([1, 2, 3], None, toks, B)])
    index.apply(w, [BlockStored([1, 2, 3], None, toks, B)])
    index.apply(w, [BlockRemoved([1])])
    assert index.find_matches(query) == {w: 3}
    assert index.block_counts() == {w: 3}
    index.apply(w, [BlockRemoved([3]), BlockRemoved([3])])
    assert index.find_matches(query) == {w: 2}
    index.apply(w, [BlockRemoved([3])])
    assert index.applied[("removed", "block_not_found")] == 1  # both copies of 3 are gone
    index.apply(w, [BlockRemoved([2, 1])])  # 2 keeps a copy, 1 had none left
    assert index.find_matches(query) == {}
    index.apply(w, [BlockRemoved([2])])
    assert index.segment_count == 0
    # a clear forgets the copies too: one store after it is undone by one removal
    index.apply(w, [BlockStored([1], None, toks[:B], B), BlockStored([1], None, toks[:B], B)])
    index.apply(w, [AllBlocksCleared(), BlockStored([1], None, toks[:B], B), BlockRemoved([1])])
    assert index.find_matches(query) == {}
    assert index.total_entries == 0


def test_query_values_no_local_hash_can_have_match_up_to_them() -> None:
    index = PrefixIndex(block_size=B)
    toks = tokens(9, 3)
    index.apply(("a", 0), [BlockStored([1, 2, 3], None, toks, B)])
    hashes = block_hashes(toks, B)
    assert index.find_matches([*hashes[:2], -1]) == {("a", 0): 2}
    assert index.find_matches([hashes[0], 2**64, hashes[2]]) == {("a", 0): 1}
    assert index.find_matches([-1]) == {}


def test_apply_outcomes_are_counted_by_type_and_status() -> None:
    index = PrefixIndex(block_size=B)
    w = ("a", 0)
    index.apply(w, [BlockStored([1], None, tokens(1, 1), B)])
    index.apply(w, [BlockStored([2], 999, tokens(1, 1), B)])
    index.apply(w, [BlockRemoved([1]), BlockRemoved([1]), AllBlocksCleared()])
    assert index.applied == {
        ("stored", "ok"): 1,
        ("stored", "parent_not_found"): 1,
        ("removed", "ok"): 1,
        ("removed", "block_not_found"): 1,
        ("cleared", "ok"): 1,
    }


def test_bytes_hashes_eagle_pairs_and_lora_do_not_crash() -> None:
    index = PrefixIndex(block_size=B)
    toks = tokens(5, 2)
    index.apply(("a", 0), [BlockStored([b"\x01" * 32, b"\x02" * 32], None, toks, B)])
    index.apply(("b", 0), [BlockStored([-5, -6], None, [(t, t + 1) for t in toks], B)])
    index.apply(("c", 0), [BlockStored([7, 8], None, toks, B, lora_name="adapter")])
    index.apply(("a", 0), [BlockRemoved([b"\x02" * 32])])
    assert index.find_matches(block_hashes(toks, B)) == {("a", 0): 1, ("b", 0): 2}
    assert index.find_matches(block_hashes(toks, B, "adapter")) == {("c", 0): 2}


def test_more_engine_hashes_than_full_blocks_is_invalid_not_a_crash() -> None:
    index = PrefixIndex(block_size=B)
    index.apply(("a", 0), [BlockStored([1, 2, 3], None, tokens(1, 2), B)])
    assert index.applied == {("stored", "invalid"): 1}
    assert index.segment_count == 0


def test_the_block_budget_prunes_oldest_entries_and_counts_them() -> None:
    index = PrefixIndex(block_size=B, max_entries=100, prune_target_ratio=0.5)
    for i in range(30):
        index.apply(("a", 0), [BlockStored([i * 10 + j for j in range(5)], None, tokens(100 + i, 5), B)])
    assert index.total_entries <= 100
    assert index.pruned_blocks >= 50
    # the newest sequence survived, the oldest did not
    assert index.find_matches(block_hashes(tokens(129, 5), B)) == {("a", 0): 5}
    assert index.find_matches(block_hashes(tokens(100, 5), B)) == {}


def test_load_stored_replaces_a_workers_state() -> None:
    index = PrefixIndex(block_size=B)
    index.apply(("a", 0), [BlockStored([1, 2], None, tokens(1, 2), B)])
    index.load_stored(("a", 0), [BlockStored([3, 4, 5], None, tokens(2, 3), B)])
    assert index.find_matches(block_hashes(tokens(1, 2), B)) == {}
    assert index.find_matches(block_hashes(tokens(2, 3), B)) == {("a", 0): 3}
