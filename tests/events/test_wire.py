"""kvmesh.events.wire against the engines' own bytes (golden payloads) and every variant of the
format the engines and other publishers produce."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvmesh._types import Tier
from kvmesh.errors import MalformedEventError
from kvmesh.events.wire import (
    REPLAY_END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    encode_batch,
    end_marker_frames,
    event_to_json,
    pack_frames,
    pack_seq,
    unpack_frames,
    unpack_seq,
)

GOLDEN = Path(__file__).resolve().parent.parent / "fixtures" / "engine-events"
TOKENS_0_31 = list(range(32))


def golden(name: str) -> bytes:
    return (GOLDEN / name).read_bytes()


def pack(obj: Any) -> bytes:
    return msgspec.msgpack.encode(obj)


def stored_map(**overrides: Any) -> dict[str, Any]:
    event = {
        "type": "BlockStored",
        "block_hashes": [1, 2],
        "parent_block_hash": None,
        "token_ids": list(range(8)),
        "block_size": 4,
    }
    event.update(overrides)
    return event


# --- golden payloads ------------------------------------------------------------------------


def test_vllm_payload_0_decodes_to_what_vllm_published() -> None:
    batch = decode_batch(golden("vllm_payload_0.bin"))
    assert batch.data_parallel_rank == 0
    assert isinstance(batch.ts, float)
    stored, removed = batch.events
    assert stored == BlockStored(
        block_hashes=[111, 222],
        parent_block_hash=None,
        token_ids=TOKENS_0_31,
        block_size=16,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )
    assert removed == BlockRemoved(block_hashes=[111], medium="GPU")
    assert stored.tier is Tier.DEVICE and stored.adapter is None


@pytest.mark.parametrize("name", ["vllm_payload_0.bin", "vllm_payload_1.bin", "sglang_payload_1.bin"])
def test_golden_payload_reencodes_byte_identical(name: str) -> None:
    payload = golden(name)
    assert encode_batch(decode_batch(payload)) == payload


def test_vllm_blockstored_uses_a_map16_header_like_vllm() -> None:
    # vLLM 0.33.0 declares 15 BlockStored fields (+ the tag); msgspec sizes the header for all of
    # them, so even 8 present keys get `de 0008`. kvmesh declares the same fields to match.
    payload = golden("vllm_payload_0.bin")
    assert b"\xde\x00\x08\xa4type\xabBlockStored" in payload
    assert b"\xde\x00\x08\xa4type\xabBlockStored" in encode_batch(decode_batch(payload))


def test_sglang_payload_0_decodes_signed_hashes_and_missing_keys() -> None:
    batch = decode_batch(golden("sglang_payload_0.bin"))
    first, second, removed = batch.events
    assert first.block_hashes == [111, -222] and first.medium == "GPU"
    assert first.lora_name is msgspec.UNSET  # SGLang 0.5.23 omits None-valued keys
    assert second == BlockStored(
        block_hashes=[333], parent_block_hash=-222, token_ids=list(range(32, 48)), block_size=16, lora_id=None
    )
    assert second.medium is msgspec.UNSET and second.tier is Tier.DEVICE
    assert removed == BlockRemoved(block_hashes=[111], medium="GPU")


def test_sglang_payload_0_reencodes_with_only_the_map_header_widened() -> None:
    # SGLang declares 9 BlockStored fields, so msgspec gives it fixmap headers (0x87, 0x86); kvmesh
    # declares vLLM's 15 and writes map16 (de 0007, de 0006). Everything else is byte-identical.
    original = golden("sglang_payload_0.bin")
    tag = b"\xa4type\xabBlockStored"
    expected = original.replace(b"\x87" + tag, b"\xde\x00\x07" + tag).replace(
        b"\x86" + tag, b"\xde\x00\x06" + tag
    )
    assert expected != original
    reencoded = encode_batch(decode_batch(original))
    assert reencoded == expected
    assert decode_batch(reencoded) == decode_batch(original)
    assert msgspec.msgpack.decode(reencoded) == msgspec.msgpack.decode(original)


def test_all_blocks_cleared_golden() -> None:
    for name in ("vllm_payload_1.bin", "sglang_payload_1.bin"):
        batch = decode_batch(golden(name))
        assert batch.events == [AllBlocksCleared()]
        assert batch.data_parallel_rank == 0


# --- forms ----------------------------------------------------------------------------------


def test_array_tagged_form_decodes_to_the_same_events() -> None:
    array_form = pack(
        [
            1.5,
            [
                ["BlockStored", [1, 2], None, list(range(8)), 4, None, "CPU_PINNED", "adapter-a"],
                ["BlockRemoved", [2], "GPU"],
                ["AllBlocksCleared"],
            ],
            3,
        ]
    )
    batch = decode_batch(array_form)
    assert batch == EventBatch(
        1.5,
        [
            BlockStored(
                block_hashes=[1, 2],
                parent_block_hash=None,
                token_ids=list(range(8)),
                block_size=4,
                lora_id=None,
                medium="CPU_PINNED",
                lora_name="adapter-a",
            ),
            BlockRemoved(block_hashes=[2], medium="GPU"),
            AllBlocksCleared(),
        ],
        3,
    )
    assert type(batch.events[0]) is BlockStored  # the array-form classes never leak out
    assert batch.events[0].tier is Tier.HOST and batch.events[0].adapter == "adapter-a"


def test_array_form_with_trailing_fields_and_only_required_ones() -> None:
    batch = decode_batch(
        pack(
            [
                0.0,
                [
                    ["BlockStored", [7], 6, [1, 2, 3, 4], 4],
                    [
                        "BlockStored",
                        [8],
                        7,
                        [5, 6, 7, 8],
                        4,
                        None,
                        "GPU",
                        None,
                        None,
                        0,
                        "full",
                        None,
                        "x",
                        "y",
                        "z",
                        None,
                        "newer",
                    ],
                ],
                None,
            ]
        )
    )
    short, long = batch.events
    assert short.medium is msgspec.UNSET and short.parent_block_hash == 6
    assert long.block_hashes == [8] and long.medium == "GPU" and long.group_idx == 0


def test_mixed_map_and_array_events_in_one_batch() -> None:
    batch = decode_batch(pack([2.0, [stored_map(), ["BlockRemoved", [1]], {"type": "AllBlocksCleared"}], 0]))
    assert [type(e) for e in batch.events] == [BlockStored, BlockRemoved, AllBlocksCleared]
    assert batch.events[1] == BlockRemoved(block_hashes=[1])


def test_batch_without_rank_element() -> None:
    # vLLM's EventBatch has omit_defaults: a None rank is left out of the array entirely.
    assert decode_batch(pack([1.0, [stored_map()]])).data_parallel_rank is None


# --- values ---------------------------------------------------------------------------------


def test_hashes_beyond_int64_and_negative_roundtrip() -> None:
    hashes = [2**64 - 1, 2**63, -(2**63), -1, 0]
    payload = pack(
        [0.0, [stored_map(block_hashes=hashes, parent_block_hash=2**64 - 2, token_ids=list(range(20)))], 0]
    )
    event = decode_batch(payload).events[0]
    assert event.block_hashes == hashes and event.parent_block_hash == 2**64 - 2
    assert decode_batch(encode_batch(decode_batch(payload))) == decode_batch(payload)


def test_bytes_hashes_roundtrip_and_render_as_hex() -> None:
    digest = bytes(range(32))
    payload = pack(
        [
            0.0,
            [
                stored_map(block_hashes=[digest, b"\xff" * 32], parent_block_hash=b"\x01" * 32),
                {"type": "BlockRemoved", "block_hashes": [digest]},
            ],
            0,
        ]
    )
    batch = decode_batch(payload)
    assert batch.events[0].block_hashes == [digest, b"\xff" * 32]
    assert decode_batch(encode_batch(batch)) == batch
    as_json = event_to_json(batch.events[0])
    assert as_json["block_hashes"] == [digest.hex(), "ff" * 32]
    assert as_json["parent_block_hash"] == "01" * 32
    assert event_to_json(batch.events[1])["block_hashes"] == [digest.hex()]


def test_missing_optional_keys_are_unset_and_not_reencoded() -> None:
    payload = pack([0.0, [stored_map(), {"type": "BlockRemoved", "block_hashes": [1]}], 0])
    batch = decode_batch(payload)
    stored, removed = batch.events
    assert (
        stored.lora_id is msgspec.UNSET
        and stored.medium is msgspec.UNSET
        and stored.lora_name is msgspec.UNSET
    )
    assert stored.tier is Tier.DEVICE and stored.adapter is None and removed.tier is Tier.DEVICE
    assert msgspec.msgpack.decode(encode_batch(batch)) == msgspec.msgpack.decode(payload)


def test_explicit_nulls_are_kept_apart_from_missing_keys() -> None:
    payload = pack([0.0, [stored_map(lora_id=None, medium=None, lora_name=None)], 0])
    assert msgspec.msgpack.decode(encode_batch(decode_batch(payload))) == msgspec.msgpack.decode(payload)


NEWER_VLLM_KEYS = {
    "extra_keys": [["adapter", ["mm-1", 0]], None],
    "group_idx": 1,
    "kv_cache_spec_kind": "sliding_window",
    "kv_cache_spec_sliding_window": 4096,
    "locality": "LOCAL",
    "ownership": "offload-tier-2",
    "session_id": "session-42",
    "lookahead_token_ids": [[9, 9], [8, 8]],
}


def test_newer_vllm_keys_are_tolerated_and_kept() -> None:
    payload = pack([0.0, [stored_map(lora_id=None, medium="GPU", lora_name=None, **NEWER_VLLM_KEYS)], 0])
    event = decode_batch(payload).events[0]
    assert event.block_hashes == [1, 2] and event.token_ids == list(range(8)) and event.tier is Tier.DEVICE
    assert event.session_id == "session-42" and event.group_idx == 1
    # Declared in vLLM 0.33.0's order, so re-encoding gives the same map back.
    assert msgspec.msgpack.decode(encode_batch(decode_batch(payload))) == msgspec.msgpack.decode(payload)


def test_unknown_keys_are_ignored() -> None:
    payload = pack(
        [
            0.0,
            [
                stored_map(some_future_key={"nested": [1, 2]}),
                {
                    "type": "BlockRemoved",
                    "block_hashes": [3],
                    "medium": "GPU",
                    "group_idx": 0,
                    "future": True,
                },
            ],
            0,
        ]
    )
    stored, removed = decode_batch(payload).events
    assert stored == decode_batch(pack([0.0, [stored_map()], 0])).events[0]
    assert removed == BlockRemoved(block_hashes=[3], medium="GPU", group_idx=0)
    assert b"some_future_key" not in encode_batch(decode_batch(payload))


def test_sglang_cache_salt_is_read_and_kept() -> None:
    """SGLang's map-form BlockStored names its cache salt: the router must see it (keyed_from)."""
    payload = pack([0.0, [stored_map(cache_salt="salt")], 0])
    stored = decode_batch(payload).events[0]
    assert stored.cache_salt == "salt" and stored.keyed_from == 0
    assert decode_batch(encode_batch(decode_batch(payload))).events[0] == stored


def test_eagle_token_pairs() -> None:
    payload = pack([0.0, [stored_map(block_hashes=[5], token_ids=[[1, 2], [3, 4], [5, 6], [7, 8]])], 0])
    event = decode_batch(payload).events[0]
    assert event.token_ids == [(1, 2), (3, 4), (5, 6), (7, 8)]
    assert event_to_json(event)["token_ids"] == [(1, 2), (3, 4), (5, 6), (7, 8)]
    assert decode_batch(encode_batch(decode_batch(payload))) == decode_batch(payload)


def test_event_to_json() -> None:
    batch = decode_batch(golden("vllm_payload_0.bin"))
    assert event_to_json(batch.events[0]) == {
        "type": "BlockStored",
        "block_hashes": [111, 222],
        "parent_block_hash": None,
        "token_ids": TOKENS_0_31,
        "block_size": 16,
        "lora_name": None,
        "medium": "GPU",
    }
    assert event_to_json(batch.events[1]) == {"type": "BlockRemoved", "block_hashes": [111], "medium": "GPU"}
    assert event_to_json(AllBlocksCleared()) == {"type": "AllBlocksCleared"}


# --- malformed ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        pytest.param(
            b"\xc1garbage", r"^malformed KV-event payload: MessagePack data is malformed", id="garbage"
        ),
        pytest.param(b"", r"^malformed KV-event payload: Input data was truncated", id="empty"),
        pytest.param(
            pack({"ts": 1.0}), r"^malformed KV-event payload: Expected `array`, got `object`$", id="not-array"
        ),
        pytest.param(pack(["now", [], 0]), r"Expected `float`, got `str` - at `\$\[0\]`$", id="ts-type"),
        pytest.param(
            pack([1.0, {"a": 1}, 0]), r"Expected `array`, got `object` - at `\$\[1\]`$", id="events-type"
        ),
        pytest.param(
            pack([1.0, [], "zero"]), r"Expected `int \| null`, got `str` - at `\$\[2\]`$", id="rank-type"
        ),
        pytest.param(
            pack([1.0, [stored_map(), stored_map(block_size="16")], 0]),
            r"^malformed KV event #1: Expected `int`, got `str` - at `\$.block_size`$",
            id="map-field-type",
        ),
        pytest.param(
            pack([1.0, [["BlockStored", [1], None, [1, 2, 3, 4], "4"]], 0]),
            r"^malformed KV event #0: Expected `int`, got `str` - at `\$\[4\]`$",
            id="array-field-type",
        ),
        pytest.param(
            pack([1.0, [stored_map(block_hashes=[1.5])], 0]),
            r"^malformed KV event #0: Expected `int \| bytes`, got `float` - at `\$.block_hashes\[0\]`$",
            id="hash-type",
        ),
        pytest.param(
            pack(
                [
                    1.0,
                    [{"type": "BlockStored", "parent_block_hash": None, "token_ids": [], "block_size": 4}],
                    0,
                ]
            ),
            r"^malformed KV event #0: Object missing required field `block_hashes`$",
            id="missing-field",
        ),
        pytest.param(
            pack([1.0, [{"type": "BlockEvicted", "block_hashes": [1]}], 0]),
            r"^malformed KV event #0: Invalid value 'BlockEvicted' - at `\$.type`$",
            id="unknown-type",
        ),
        pytest.param(
            pack([1.0, [7], 0]), r"^malformed KV event #0: Expected `object`, got `int`$", id="event-int"
        ),
        pytest.param(
            pack([1.0, [{"type": "BlockRemoved", "block_hashes": ["0xff"]}], 0]),
            r"^malformed KV event #0: Expected `int \| bytes`, got `str` - at `\$.block_hashes\[0\]`$",
            id="hash-as-string",
        ),
    ],
)
def test_malformed_payload_names_the_problem(payload: bytes, message: str) -> None:
    with pytest.raises(MalformedEventError, match=message):
        decode_batch(payload)


# --- frames ---------------------------------------------------------------------------------


def test_frames_roundtrip() -> None:
    frames = pack_frames(b"kv", 2**63 + 5, b"payload")
    assert frames == [b"kv", b"\x80\x00\x00\x00\x00\x00\x00\x05", b"payload"]
    assert unpack_frames(frames) == (b"kv", 2**63 + 5, b"payload")
    assert pack_seq(1) == b"\x00" * 7 + b"\x01" and unpack_seq(pack_seq(0)) == 0


def test_end_marker() -> None:
    assert end_marker_frames() == [b"", b"\xff" * 8, b""]
    assert unpack_seq(b"\xff" * 8) == REPLAY_END_SEQ == -1


@pytest.mark.parametrize(
    ("frames", "message"),
    [
        ([b"", pack_seq(0)], "^KV-event message must have 3 frames, got 2$"),
        ([b"", pack_seq(0), b"", b""], "^KV-event message must have 3 frames, got 4$"),
        ([b"", b"\x00" * 7, b"x"], "^sequence frame must be 8 bytes, got 7$"),
    ],
)
def test_malformed_frames(frames: list[bytes], message: str) -> None:
    with pytest.raises(MalformedEventError, match=message):
        unpack_frames(frames)


# --- property -------------------------------------------------------------------------------

hashes = st.one_of(st.integers(-(2**63), 2**64 - 1), st.binary(min_size=32, max_size=32))
optional_str = st.one_of(st.none(), st.text(max_size=8))
unset_or = lambda s: st.one_of(st.just(msgspec.UNSET), s)  # noqa: E731
stored_events = st.builds(
    BlockStored,
    block_hashes=st.lists(hashes, min_size=1, max_size=4),
    parent_block_hash=st.one_of(st.none(), hashes),
    token_ids=st.lists(st.integers(0, 2**31), max_size=16),
    block_size=st.integers(1, 64),
    lora_id=unset_or(st.one_of(st.none(), st.integers(0, 100))),
    medium=unset_or(optional_str),
    lora_name=unset_or(optional_str),
)
removed_events = st.builds(
    BlockRemoved, block_hashes=st.lists(hashes, min_size=1, max_size=4), medium=unset_or(optional_str)
)
batches = st.builds(
    EventBatch,
    ts=st.floats(allow_nan=False),
    events=st.lists(st.one_of(stored_events, removed_events, st.just(AllBlocksCleared())), max_size=6),
    data_parallel_rank=st.one_of(st.none(), st.integers(0, 64)),
)


@given(batches)
def test_encode_decode_roundtrip(batch: EventBatch) -> None:
    payload = encode_batch(batch)
    assert decode_batch(payload) == batch
    assert encode_batch(decode_batch(payload)) == payload


def test_package_exports() -> None:
    import kvmesh.events as events

    assert events.__all__ == sorted(events.__all__)
    assert set(events.__all__) == {
        "AllBlocksCleared",
        "BatchPublisher",
        "BlockRemoved",
        "BlockStored",
        "Event",
        "EventBatch",
        "EventSubscriber",
        "KvEventPublisher",
        "SubscriberStats",
        "decode_batch",
        "encode_batch",
        "event_to_json",
    }
