"""kvmesh.mock.block_pool: ref counts, LRU eviction order, prefix cache and its events."""

from __future__ import annotations

import random

import pytest

from kvmesh.events.wire import AllBlocksCleared, BlockRemoved, BlockStored
from kvmesh.mock.block_hash import extend_block_hashes
from kvmesh.mock.block_pool import BlockPool, KVBlock

BS = 4


def _hashes(tokens: list[int], salt: int = 7) -> list[int]:
    out: list[int] = []
    extend_block_hashes(out, tokens, BS, salt)
    return out


def _check_invariants(pool: BlockPool) -> None:
    free = list(pool.free_queue)
    assert len(free) == pool.num_free
    assert all(b.ref_cnt == 0 for b in free)
    assert {b.block_id for b in free} == {b.block_id for b in pool.blocks if b.ref_cnt == 0}
    for h, b in pool.cached.items():
        assert b.block_hash == h
    assert sum(1 for b in pool.blocks if b.block_hash is not None) == len(pool.cached)


def test_hashes_are_chained_salted_and_unsigned() -> None:
    tokens = list(range(12))
    a, b = _hashes(tokens, salt=1), _hashes(tokens, salt=2)
    assert len(a) == 3 and a != b
    assert _hashes(tokens[:8], salt=1) == a[:2]  # a prefix has the same hashes
    changed = _hashes([99, *tokens[1:]], salt=1)
    assert all(x != y for x, y in zip(changed, a, strict=True))  # a change propagates down the chain
    assert all(0 <= h < 2**64 for h in a)


def test_allocation_takes_the_least_recently_freed_block_first() -> None:
    pool = BlockPool(4, BS)
    blocks = pool.allocate(4)
    assert pool.num_free == 0
    pool.free([blocks[2], blocks[0]])
    pool.free([blocks[3]])
    assert [b.block_id for b in pool.free_queue] == [2, 0, 3]
    assert [b.block_id for b in pool.allocate(2)] == [2, 0]
    _check_invariants(pool)


def test_caching_publishes_one_chained_event_and_eviction_a_removal() -> None:
    pool = BlockPool(3, BS)
    tokens = list(range(10))  # two full blocks and a partial one
    hashes = _hashes(tokens)
    blocks = pool.allocate(3)
    pool.cache_blocks(blocks, hashes, tokens, 0, 2)
    (stored,) = pool.take_events()
    assert stored == BlockStored(
        block_hashes=hashes,
        parent_block_hash=None,
        token_ids=tokens[:8],
        block_size=BS,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )
    assert pool.cached_prefix(hashes, 5) == blocks[:2]
    pool.free(reversed(blocks))
    # the tail block is evicted first; the partial third block held nothing
    got = pool.allocate(2)
    assert [b.block_id for b in got] == [2, 1]
    assert pool.take_events() == [BlockRemoved(block_hashes=[hashes[1]], medium="GPU")]
    assert pool.cached_prefix(hashes, 5) == blocks[:1]
    _check_invariants(pool)


def test_a_prefix_hit_pulls_a_free_block_out_of_the_eviction_queue() -> None:
    pool = BlockPool(2, BS)
    tokens = list(range(4))
    hashes = _hashes(tokens)
    (block,) = pool.allocate(1)
    pool.cache_blocks([block], hashes, tokens, 0, 1)
    pool.free([block])
    hits = pool.cached_prefix(hashes, 1)
    pool.touch(hits)
    assert block.ref_cnt == 1 and pool.num_free == 1
    pool.allocate(1)
    assert pool.cached_prefix(hashes, 1) == [block]  # not evicted while held
    _check_invariants(pool)


def test_a_duplicate_block_stays_private_and_publishes_nothing() -> None:
    pool = BlockPool(4, BS)
    tokens = list(range(8))
    hashes = _hashes(tokens)
    first, second = pool.allocate(2), pool.allocate(2)
    pool.cache_blocks(first, hashes, tokens, 0, 2)
    pool.take_events()
    pool.cache_blocks(second, hashes, tokens, 0, 2)
    assert pool.take_events() == []
    pool.free(reversed(second))
    pool.allocate(4 - 2)  # reusing the private blocks removes nothing
    assert pool.take_events() == []


def test_max_blocks_caps_the_prefix() -> None:
    pool = BlockPool(4, BS)
    tokens = list(range(12))
    hashes = _hashes(tokens)
    blocks = pool.allocate(3)
    pool.cache_blocks(blocks, hashes, tokens, 0, 3)
    assert len(pool.cached_prefix(hashes, 2)) == 2
    assert pool.cached_prefix([12345, *hashes[1:]], 3) == []


def test_reset_only_when_nothing_is_in_use() -> None:
    pool = BlockPool(2, BS)
    tokens = list(range(4))
    (block,) = pool.allocate(1)
    pool.cache_blocks([block], _hashes(tokens), tokens, 0, 1)
    pool.take_events()
    assert pool.reset_prefix_cache() is False
    pool.free([block])
    assert pool.reset_prefix_cache() is True
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.cached == {} and block.block_hash is None


def test_double_free_is_caught() -> None:
    pool = BlockPool(1, BS)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(AssertionError, match="double free"):
        pool.free([block])


def test_random_workload_keeps_events_and_lru_order_in_step_with_a_reference_model() -> None:
    """Brute-force reference: a Python list as the LRU queue and a dict replaying the events."""
    rng = random.Random(1)
    pool = BlockPool(24, BS)
    lru: list[int] = list(range(24))  # reference eviction order
    index: dict[int, tuple[int | None, list[int]]] = {}
    held: list[list[KVBlock]] = []
    prefixes = [[rng.randrange(50) for _ in range(16)] for _ in range(4)]
    for _ in range(400):
        if held and (rng.random() < 0.45 or pool.num_free < 8):
            blocks = held.pop(rng.randrange(len(held)))
            pool.free(reversed(blocks))
            for b in reversed(blocks):
                if b.ref_cnt == 0:
                    lru.append(b.block_id)
        else:
            tokens = rng.choice(prefixes)[: rng.randrange(4, 17)] + [
                rng.randrange(50) for _ in range(rng.randrange(6))
            ]
            hashes = _hashes(tokens)
            hits = pool.cached_prefix(hashes, (len(tokens) - 1) // BS)
            need = -(-len(tokens) // BS) - len(hits)
            if need > pool.num_free - sum(1 for b in hits if b.ref_cnt == 0):
                continue
            for b in hits:
                if b.ref_cnt == 0:
                    lru.remove(b.block_id)
            pool.touch(hits)
            new = pool.allocate(need)
            assert [b.block_id for b in new] == lru[:need]
            del lru[:need]
            blocks = hits + new
            pool.cache_blocks(blocks, hashes, tokens, len(hits), len(tokens) // BS)
            held.append(blocks)
        for ev in pool.take_events():
            if isinstance(ev, BlockStored):
                parent = ev.parent_block_hash
                for j, h in enumerate(ev.block_hashes):
                    assert h not in index
                    index[h] = (parent, list(ev.token_ids[j * BS : (j + 1) * BS]))
                    parent = h
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    del index[h]
        assert [b.block_id for b in pool.free_queue] == lru
        snapshot = {e.block_hashes[0]: (e.parent_block_hash, e.token_ids) for e in pool.snapshot()}
        assert snapshot == index
        _check_invariants(pool)
