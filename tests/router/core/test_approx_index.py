"""Approximate index: entries live ``ttl`` seconds after their last routing, a size cap prunes."""

from __future__ import annotations

import random

from kvmesh.hashing import block_hashes
from kvmesh.router.core.approx_index import ApproxIndex

B = 4


def tokens(seed: int, n_blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n_blocks * B)]


def test_approx_entries_expire_after_their_ttl_and_a_reroute_refreshes_them() -> None:
    index = ApproxIndex(ttl=10.0)
    hashes = block_hashes(tokens(1, 6), B)
    index.record(("a", 0), hashes, now=0.0)
    index.record(("b", 0), hashes[:2], now=0.0)
    index.record(("a", 0), hashes[:3], now=5.0)  # refresh the first three blocks on a
    index.expire(10.0)
    assert index.find_matches(hashes) == {("a", 0): 3}
    index.expire(15.0)
    assert index.find_matches(hashes) == {}
    assert index.size == 0
    assert index.segment_count == 0


def test_approx_size_cap_prunes_earliest_expiry_first_to_the_target_ratio() -> None:
    index = ApproxIndex(ttl=100.0, max_blocks=10, prune_target_ratio=0.8)
    old, new = block_hashes(tokens(1, 6), B), block_hashes(tokens(2, 5), B)
    index.record(("a", 0), old, now=0.0)
    index.record(("b", 0), new, now=1.0)  # 11 entries > 10 -> prune to 8: a's 3 oldest go
    assert index.size == 8
    assert index.pruned_blocks == 3
    # the earliest-expiring entries are a's first blocks, which cuts a's whole prefix
    assert index.find_matches(old) == {}
    assert index.find_matches(new) == {("b", 0): 5}
