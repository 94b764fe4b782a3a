"""kvmesh.hashing against the golden vectors computed by NVIDIA Dynamo 1.6.1's own router."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from xxhash import xxh3_64_intdigest

from kvmesh.hashing import BASE_SEED, block_hashes, seed_for, sequence_hashes

VECTORS = json.loads((Path(__file__).parent / "fixtures" / "hash-vectors.json").read_text())


def _tokens(case: dict[str, Any]) -> list[int]:
    tokens = case["tokens"]
    # The fixture spells long token lists as Python expressions (range / comprehension) of ints only.
    return list(eval(tokens, {"__builtins__": {"range": range}})) if isinstance(tokens, str) else tokens


@pytest.mark.parametrize("case", VECTORS["cases"], ids=[c["name"] for c in VECTORS["cases"]])
def test_golden_vectors(case: dict[str, Any]) -> None:
    assert block_hashes(_tokens(case), case["block_size"], case["lora_name"]) == case["local_hashes"]


def test_golden_file_is_not_empty() -> None:
    assert len(VECTORS["cases"]) >= 6
    assert any(c["lora_name"] for c in VECTORS["cases"])


def test_partial_block_and_short_input() -> None:
    assert block_hashes(list(range(15)), 16) == []
    assert block_hashes([], 16) == []
    assert len(block_hashes(list(range(33)), 16)) == 2


def test_accepts_any_sequence_type() -> None:
    tokens = list(range(64))
    assert block_hashes(tuple(tokens), 16) == block_hashes(tokens, 16) == block_hashes(range(64), 16)


def test_the_partial_last_block_never_changes_the_hashes() -> None:
    """The tokens past the last whole block are left out, whatever they are: a list is converted
    whole and those bytes never hashed, and an id out of range among them is no error (it would
    be in a whole block)."""
    whole = [7 * i + 256 for i in range(48)]
    expected = block_hashes(whole, 16)
    for tail in ([1], list(range(15)), [2**32], [-1, 5]):
        assert block_hashes(whole + tail, 16) == expected
        assert block_hashes(tuple(whole + tail), 16) == expected


def test_rejects_bad_block_size_and_token_range() -> None:
    with pytest.raises(ValueError, match="block_size must be positive, got 0"):
        block_hashes([1, 2], 0)
    with pytest.raises(OverflowError):
        block_hashes([2**32] * 16, 16)
    with pytest.raises(OverflowError):
        block_hashes([-1] * 16, 16)


def test_lora_seed() -> None:
    assert seed_for(None) == seed_for("") == BASE_SEED
    assert seed_for("my-lora") == (BASE_SEED + xxh3_64_intdigest(b"my-lora", 0)) % 2**64


def test_sequence_hashes_follow_the_rolling_definition() -> None:
    local = block_hashes(list(range(64)), 16)
    seq = sequence_hashes(local)
    assert seq[0] == local[0]
    for i in range(1, len(local)):
        assert seq[i] == xxh3_64_intdigest(struct.pack("<QQ", seq[i - 1], local[i]), BASE_SEED)
    assert sequence_hashes([]) == []


@given(st.lists(st.integers(0, 2**32 - 1), max_size=200), st.lists(st.integers(0, 2**32 - 1), max_size=200))
def test_equal_sequence_hash_means_equal_prefix(a: list[int], b: list[int]) -> None:
    """Rolling hashes make block i's hash a function of the whole prefix up to block i."""
    sa, sb = sequence_hashes(block_hashes(a, 4)), sequence_hashes(block_hashes(b, 4))
    for i in range(min(len(sa), len(sb))):
        same_prefix = a[: 4 * (i + 1)] == b[: 4 * (i + 1)]
        assert (sa[i] == sb[i]) == same_prefix
