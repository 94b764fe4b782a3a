"""kvmesh.worker.block_state: the cached set rebuilt from events, dumped parents-first; kv_state's shape."""

from __future__ import annotations

import random

from kvmesh.events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    encode_batch,
)
from kvmesh.worker.block_state import CachedBlockState, kv_state_answer, rank_state

BS = 2


def stored(hashes: list[int], parent: int | None, first_token: int = 0, **kw: object) -> BlockStored:
    tokens = list(range(first_token, first_token + BS * len(hashes)))
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS, **kw)  # type: ignore[arg-type]


def test_stored_removed_cleared() -> None:
    state = CachedBlockState()
    state.apply([stored([1, 2, 3], None), stored([4], 3, first_token=6)])
    assert state.hashes() == {1, 2, 3, 4}
    state.apply([BlockRemoved(block_hashes=[2, 99], medium="GPU")])
    assert state.hashes() == {1, 3, 4}
    state.apply([AllBlocksCleared()])
    assert len(state) == 0


def test_dump_merges_chains_and_splits_tokens_per_block() -> None:
    state = CachedBlockState()
    state.apply(
        [
            stored([1, 2], None, medium="GPU", lora_name=None),
            stored([3], 2, first_token=4, medium="GPU", lora_name=None),
        ]
    )
    [event] = state.dump()
    assert event.block_hashes == [1, 2, 3]
    assert event.parent_block_hash is None
    assert event.token_ids == [0, 1, 2, 3, 4, 5]
    assert event.medium == "GPU"


def test_dump_puts_parents_first_even_when_a_parent_was_stored_again_later() -> None:
    state = CachedBlockState()
    state.apply([stored([1], None), stored([2], 1, first_token=2)])
    # The parent is evicted and cached again after its child: insertion order is now child first.
    state.apply([BlockRemoved(block_hashes=[1]), stored([1], None)])
    order = [h for e in state.dump() for h in e.block_hashes]
    assert order == [1, 2]


def test_an_orphan_keeps_its_parent_hash() -> None:
    state = CachedBlockState()
    state.apply([stored([1, 2], None), BlockRemoved(block_hashes=[1])])
    [event] = state.dump()
    assert (event.block_hashes, event.parent_block_hash, event.token_ids) == ([2], 1, [2, 3])


def test_groups_are_kept_apart() -> None:
    state = CachedBlockState()
    state.apply([stored([1], None, group_idx=0), stored([1], None, group_idx=1)])
    state.apply([BlockRemoved(block_hashes=[1], group_idx=1)])
    assert state.hashes(0) == {1}
    assert state.hashes(1) == set()


def test_replaying_the_dump_rebuilds_the_same_state() -> None:
    """Random store/evict traffic: a fresh state fed only the dump equals the original."""
    rng = random.Random(7)
    state = CachedBlockState()
    next_hash = 1
    live: list[int] = []
    for _ in range(300):
        if live and rng.random() < 0.4:
            victim = rng.choice(live)
            live.remove(victim)
            state.apply([BlockRemoved(block_hashes=[victim])])
        else:
            parent = rng.choice([None, *live]) if live else None
            hashes = list(range(next_hash, next_hash + rng.randint(1, 3)))
            next_hash += len(hashes)
            live.extend(hashes)
            state.apply([stored(hashes, parent, first_token=hashes[0] * BS)])
    dump = state.dump()
    seen: set[int] = set()
    for event in dump:
        assert (
            event.parent_block_hash is None
            or event.parent_block_hash in seen
            or event.parent_block_hash not in live
        )
        seen.update(event.block_hashes)  # type: ignore[arg-type]
    rebuilt = CachedBlockState()
    # Through the wire codec too, as a router receives it.
    rebuilt.apply(decode_batch(encode_batch(EventBatch(0.0, list(dump)))).events)
    assert rebuilt.hashes() == state.hashes() == set(live)
    assert [e.token_ids for e in rebuilt.dump()] == [e.token_ids for e in dump]


def test_a_hash_cached_twice_stays_until_its_last_copy_is_removed() -> None:
    """vLLM caches a second block under the same hash when it recomputes a fully cached prompt's
    last block, and reports each copy's eviction separately."""
    state = CachedBlockState()
    state.apply([stored([1, 2], None), stored([2], 1, first_token=2)])
    state.apply([BlockRemoved(block_hashes=[2])])
    assert state.hashes() == {1, 2}
    state.apply([BlockRemoved(block_hashes=[2])])
    assert state.hashes() == {1}
    state.apply([stored([2], 1, first_token=2), AllBlocksCleared(), stored([2], 1, first_token=2)])
    state.apply([BlockRemoved(block_hashes=[2])])
    assert state.hashes() == set()


def test_the_dump_repeats_a_block_once_per_extra_copy() -> None:
    """A router cold-started from the dump must count the copies too, or the first copy's
    eviction would drop a block the engine still caches."""
    state = CachedBlockState()
    state.apply([stored([1, 2], None), stored([2], 1, first_token=2)])
    rebuilt = CachedBlockState()
    rebuilt.apply(decode_batch(encode_batch(EventBatch(0.0, list(state.dump())))).events)
    rebuilt.apply([BlockRemoved(block_hashes=[2])])
    assert rebuilt.hashes() == {1, 2}
    rebuilt.apply([BlockRemoved(block_hashes=[2])])
    assert rebuilt.hashes() == {1}


def test_kv_state_answer_lists_each_rank_by_rank_with_json_events() -> None:
    state = CachedBlockState()
    state.apply([stored([1, 2], None)])
    ranks = [rank_state(1, None, []), rank_state(0, 7, state.dump())]
    answer = kv_state_answer(BS, ranks)
    assert answer["block_size"] == BS
    assert [(r["dp_rank"], r["last_seq"]) for r in answer["ranks"]] == [(0, 7), (1, None)]
    (event,) = answer["ranks"][0]["events"]
    assert event["type"] == "BlockStored"
    assert (event["block_hashes"], event["parent_block_hash"], event["token_ids"]) == (
        [1, 2],
        None,
        [0, 1, 2, 3],
    )
    assert answer["ranks"][1]["events"] == []
