"""TensorRT-LLM event dicts -> kvmesh wire events (kvmesh/adapters/trtllm/convert.py)."""

from __future__ import annotations

import pytest

from kvmesh.adapters.trtllm.convert import EventConverter, map_hash
from kvmesh.events.wire import AllBlocksCleared, BlockRemoved, BlockStored
from tests.adapters.trtllm.payloads import block, created, removed, stored, updated

B = 4


def test_hashes_map_to_signed_64_bit_the_same_way_in_every_spelling() -> None:
    assert map_hash(5) == 5
    assert map_hash(2**64 - 1) == -1  # u64 read as two's complement, like Dynamo
    assert map_hash(2**63) == -(2**63)
    assert map_hash(-7) == -7
    digest = "ab" * 32  # a v2_sha256 hex key: its first 8 bytes, big-endian
    assert map_hash(digest) == int("ab" * 8, 16) - 2**64
    assert map_hash(int("ab" * 8, 16)) == map_hash(digest)  # the v2_sha256_64 int of the same block
    with pytest.raises(ValueError):
        map_hash("abc")


def test_created_sets_capacity_and_publishes_nothing() -> None:
    c = EventConverter(B)
    assert c.convert([created(0, blocks=512)]) == []
    assert c.capacity_blocks == {0: 512}
    assert c.max_window == 4096


def test_a_stored_chain_becomes_one_block_stored_with_the_partial_tail_dropped() -> None:
    c = EventConverter(B)
    out = c.convert(
        [
            created(0),
            stored(1, None, [block(11, [1, 2, 3, 4]), block(12, [5, 6, 7, 8]), block(13, [9, 10])]),
        ]
    )
    assert out == [
        (
            0,
            BlockStored(
                block_hashes=[11, 12],
                parent_block_hash=None,
                token_ids=[1, 2, 3, 4, 5, 6, 7, 8],
                block_size=B,
                lora_id=None,
                medium="GPU",
                lora_name=None,
            ),
        )
    ]
    assert c.dropped["partial_block"] == 1
    # The partial block's removal is swallowed; a published block's is not.
    assert c.convert([removed(2, [13, 12])]) == [(0, BlockRemoved(block_hashes=[12], medium="GPU"))]


def test_a_prompt_shorter_than_a_block_publishes_nothing() -> None:
    """TensorRT-LLM's own unit test: 5 tokens, 64 per block -> one 4-token block, no parent."""
    c = EventConverter(64)
    assert c.convert([created(0), stored(1, None, [block(7, [1, 2, 3, 4])])]) == []
    assert c.convert([removed(2, [7])]) == []


def test_blocks_below_an_unpublished_block_stay_unpublished() -> None:
    c = EventConverter(B)
    c.convert([created(0), stored(1, None, [block(1, [1, 2])])])
    assert c.convert([stored(2, 1, [block(2, [1, 2, 3, 4])])]) == []
    assert c.convert([removed(3, [2, 1])]) == []


def test_an_oversized_block_or_a_multimodal_token_ends_the_chain() -> None:
    c = EventConverter(B)
    out = c.convert(
        [
            created(0),
            stored(1, None, [block(1, [1, 2, 3, 4]), block(2, [1, 2, 3, 4, 5]), block(3, [1, 2, 3, 4])]),
        ]
    )
    assert [e.block_hashes for _, e in out] == [[1]]
    mm = block(4, [1, 2, 3, 4])
    mm["tokens"][0]["token_id"] = "f" * 64  # KV cache manager V2: a multimodal item digest
    assert c.convert([stored(2, None, [mm])]) == []
    assert c.dropped["unusable_block"] == 2


def test_hex_hashes_and_newer_block_fields() -> None:
    c = EventConverter(B)
    h1, h2 = "11" * 32, "22" * 32
    b1 = block(h1, [1, 2, 3, 4]) | {"lora_id": 3, "lora_name": "ad", "cache_salt": "s", "mm_keys": []}
    out = c.convert([created(0), stored(1, "00" * 32, [b1])])
    ((_rank, event),) = out
    assert isinstance(event, BlockStored)
    assert event.block_hashes == [map_hash(h1)]
    assert event.parent_block_hash == 0
    assert (event.lora_id, event.lora_name) == (3, "ad")
    assert c.convert([removed(2, [h1, h2])]) == [
        (0, BlockRemoved(block_hashes=[map_hash(h1), map_hash(h2)], medium="GPU"))
    ]


def test_updated_is_counted_and_not_published() -> None:
    c = EventConverter(B)
    c.convert([created(0), stored(1, None, [block(1, [1, 2, 3, 4])])])
    assert c.convert([updated(2, 1)]) == []
    assert c.dropped["updated"] == 1


def test_only_the_full_attention_window_is_published() -> None:
    c = EventConverter(B)
    out = c.convert(
        [
            created(0, window=128),
            created(1, window=4096),
            stored(2, None, [block(1, [1, 2, 3, 4])], window=128),
            stored(3, None, [block(1, [1, 2, 3, 4])], window=4096),
            removed(4, [1], window=128),
        ]
    )
    assert [(type(e).__name__, e.block_hashes) for _, e in out] == [("BlockStored", [1])]  # type: ignore[union-attr]
    assert c.dropped["window"] == 2
    assert c.capacity_blocks == {0: 100}


def test_attention_dp_ranks_have_their_own_event_ids_and_suppressions() -> None:
    c = EventConverter(B)
    out = c.convert(
        [
            created(0, rank=0),
            created(0, rank=1),
            stored(1, None, [block(1, [1, 2, 3, 4])], rank=1),
            stored(1, None, [block(1, [1, 2])], rank=0),
            removed(2, [1], rank=0),
            removed(2, [1], rank=1),
        ]
    )
    assert [(r, type(e).__name__) for r, e in out] == [(1, "BlockStored"), (1, "BlockRemoved")]
    assert c.resyncs == 0


def test_an_event_id_gap_clears_the_rank_once() -> None:
    c = EventConverter(B)
    c.convert([created(0), stored(1, None, [block(1, [1, 2, 3, 4])])])
    out = c.convert([stored(5, 1, [block(2, [5, 6, 7, 8])])])
    assert out[0] == (0, AllBlocksCleared())
    assert isinstance(out[1][1], BlockStored)
    assert c.resyncs == 1
    assert c.convert([removed(6, [2])]) == [(0, BlockRemoved(block_hashes=[2], medium="GPU"))]


def test_an_engine_restart_clears_the_rank() -> None:
    c = EventConverter(B)
    c.convert([created(0), stored(1, None, [block(1, [1, 2, 3, 4])])])
    out = c.convert([created(0, blocks=50), stored(1, None, [block(9, [1, 2, 3, 4])])])
    assert out[0] == (0, AllBlocksCleared())
    assert out[1][1].block_hashes == [9]  # type: ignore[union-attr]
    assert c.capacity_blocks == {0: 50}


def test_a_bridge_that_starts_late_clears_first() -> None:
    c = EventConverter(B)
    out = c.convert([stored(7, None, [block(1, [1, 2, 3, 4])])])
    assert out[0] == (0, AllBlocksCleared())


def test_malformed_events_are_counted_not_raised() -> None:
    c = EventConverter(B)
    assert c.convert([{"event_id": 0}, {"event_id": 1, "data": {"type": "stored"}}]) == []
    assert c.dropped["malformed"] == 2


def test_a_gap_is_cleared_even_when_the_event_after_it_is_malformed() -> None:
    c = EventConverter(B)
    c.convert([created(0)])
    assert c.convert([{"event_id": 9, "data": {"type": "stored"}}]) == [(0, AllBlocksCleared())]
    assert c.dropped["malformed"] == 1
