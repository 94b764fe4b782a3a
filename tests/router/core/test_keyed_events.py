"""Engine events for blocks keyed by more than their tokens (a cache salt, a multimodal hash) must
not be indexed under the token-only hash: a plain prompt with the same tokens would be credited
with a cache the engine will never share with it."""

from __future__ import annotations

from kvmesh.events.wire import BlockStored
from kvmesh.hashing import block_hashes
from kvmesh.router.core.event_index import PrefixIndex

B = 4
TOKENS = list(range(16))  # four blocks
W = ("w", 0)


def _index(*events: BlockStored) -> PrefixIndex:
    index = PrefixIndex(block_size=B)
    index.apply(W, list(events))
    return index


def _depth(index: PrefixIndex) -> int:
    return index.find_matches(block_hashes(TOKENS, B)).get(W, 0)


def test_plain_blocks_are_indexed() -> None:
    assert _depth(_index(BlockStored([1, 2, 3, 4], None, TOKENS, B))) == 4


def test_a_salted_run_is_not_indexed_nor_are_its_children() -> None:
    salted = BlockStored([1, 2], None, TOKENS[:8], B, cache_salt="tenant-a")
    child = BlockStored([3, 4], 2, TOKENS[8:], B)
    assert _depth(_index(salted, child)) == 0


def test_blocks_before_the_first_extra_key_are_indexed_the_rest_not() -> None:
    # vLLM: per-block extra keys, the third block holds an image (its mm hash)
    mm = BlockStored([1, 2, 3, 4], None, TOKENS, B, extra_keys=[None, None, [("mm", "abc", 0)], None])
    assert _depth(_index(mm)) == 2


def test_empty_extra_keys_change_nothing() -> None:
    plain = BlockStored([1, 2, 3, 4], None, TOKENS, B, extra_keys=[None, None, None, None], cache_salt=None)
    assert _depth(_index(plain)) == 4
