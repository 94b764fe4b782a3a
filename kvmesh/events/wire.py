"""The KV-event wire format that vLLM and SGLang publish over ZMQ, and kvmesh speaks unchanged.

A message is three frames: ``topic`` (bytes, may be empty), ``seq`` (u64 big-endian, +1 per
batch) and ``payload``: msgpack ``[ts, events, data_parallel_rank]``. Each event is a tagged struct
(``type`` = class name). Engines encode events as maps; other publishers (older versions, Dynamo's
relay) as arrays ``["BlockStored", field, ...]``. The decoder accepts both, ignores keys it does not
know (newer vLLM adds several) and tolerates missing optional keys (SGLang omits None values).

Block hashes are opaque: signed or unsigned 64-bit ints, or raw bytes.

Encoding reproduces vLLM 0.33.0's bytes exactly. msgspec sizes a struct's map header by the
fields the struct *declares* (then patches the count), so the header width depends on the
declaration, not on the keys present: vLLM's BlockStored declares 15 fields (+ the tag) and gets
a map16 header (``de 0008``), SGLang 0.5.23's declares 9 and gets a fixmap (``0x87``). kvmesh
declares vLLM's fields in vLLM's order; re-encoding an SGLang payload therefore differs from the
original only in those header bytes (and drops SGLang's ``cache_salt``, which kvmesh does not keep).
"""

from __future__ import annotations

import struct
from typing import Any, Union

import msgspec
from msgspec import UNSET, UnsetType

from kvmesh._types import Tier, tier_of_medium
from kvmesh.errors import MalformedEventError

EngineHashT = Union[int, bytes]
# SGLang's EAGLE mode publishes token ids as pairs; everything else publishes plain ints.
TokenT = Union[int, tuple[int, int]]


class BlockStored(msgspec.Struct, tag=True, frozen=True, omit_defaults=True, gc=False):
    block_hashes: list[EngineHashT]
    parent_block_hash: EngineHashT | None
    token_ids: list[TokenT]
    block_size: int
    # UNSET (absent on the wire) is kept apart from an explicit None so that re-encoding a decoded
    # batch gives back the publisher's exact bytes: vLLM sends these keys as null, SGLang omits them.
    lora_id: int | UnsetType | None = UNSET
    medium: str | UnsetType | None = UNSET
    lora_name: str | UnsetType | None = UNSET
    extra_keys: Any = UNSET
    # The optional keys vLLM 0.33.0 declares after extra_keys, in its order. kvmesh never reads
    # them (typed Any, so a future type change cannot break decoding), but declaring them keeps
    # them on re-encode and gives the struct vLLM's field count: msgspec sizes a struct's map
    # header for all declared fields (here 16 with the tag), so like vLLM it writes a map16
    # header (0xde 0x0008) where a struct with at most 15 would write a fixmap (0x88).
    group_idx: Any = UNSET
    kv_cache_spec_kind: Any = UNSET
    kv_cache_spec_sliding_window: Any = UNSET
    locality: Any = UNSET
    ownership: Any = UNSET
    session_id: Any = UNSET
    lookahead_token_ids: Any = UNSET
    # SGLang's per-request cache namespace (its map-form events carry it by name).
    cache_salt: Any = UNSET

    @property
    def keyed_from(self) -> int | None:
        """Index of the first block the engine keys by more than its tokens (a cache salt, a
        multimodal hash: vLLM's per-block ``extra_keys``, SGLang's ``cache_salt``), or None.
        From there on, two prefixes with equal tokens are different cache entries, so a router
        that hashes tokens alone must not index them (their children inherit the key).

        vLLM 0.33.0 publishes per block the untagged keys of its block hash: the bare LoRA name
        (on every block of an adapter's request: the router keys adapters itself, by
        ``lora_name``), the bare cache salt (first block), ``(mm identifier, offset)`` pairs and
        prompt-embeds digests. Any key but the adapter's name keys the block."""
        if self.cache_salt not in (UNSET, None, ""):
            return 0
        extra = self.extra_keys
        if isinstance(extra, (list, tuple)):
            adapter = self.lora_name if isinstance(self.lora_name, str) else None
            for i, keys in enumerate(extra):
                if keys and any(key != adapter for key in keys):
                    return i
        return None

    @property
    def tier(self) -> Tier:
        return tier_of_medium(self.medium or None)

    @property
    def adapter(self) -> str | None:
        """The LoRA adapter name, or None for the base model."""
        return self.lora_name or None


class BlockRemoved(msgspec.Struct, tag=True, frozen=True, omit_defaults=True, gc=False):
    block_hashes: list[EngineHashT]
    medium: str | UnsetType | None = UNSET
    # vLLM 0.33.0's further optional keys, kept on re-encode and otherwise unused.
    group_idx: Any = UNSET
    locality: Any = UNSET
    ownership: Any = UNSET

    @property
    def tier(self) -> Tier:
        return tier_of_medium(self.medium or None)


class AllBlocksCleared(msgspec.Struct, tag=True, frozen=True, gc=False):
    pass


Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class EventBatch(msgspec.Struct, array_like=True, frozen=True, gc=False):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


# The same three events in array form, for publishers that encode structs as arrays.
class _ArrayBlockStored(BlockStored, tag="BlockStored", array_like=True, frozen=True):
    pass


class _ArrayBlockRemoved(BlockRemoved, tag="BlockRemoved", array_like=True, frozen=True):
    pass


class _ArrayAllBlocksCleared(AllBlocksCleared, tag="AllBlocksCleared", array_like=True, frozen=True):
    pass


class _RawEventBatch(msgspec.Struct, array_like=True, frozen=True):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_map_decoder = msgspec.msgpack.Decoder(EventBatch)
_raw_decoder = msgspec.msgpack.Decoder(_RawEventBatch)
_map_event_decoder = msgspec.msgpack.Decoder(Event)
_array_event_decoder = msgspec.msgpack.Decoder(
    Union[_ArrayBlockStored, _ArrayBlockRemoved, _ArrayAllBlocksCleared]
)
_TO_MAP_FORM: dict[type, type] = {
    _ArrayBlockStored: BlockStored,
    _ArrayBlockRemoved: BlockRemoved,
    _ArrayAllBlocksCleared: AllBlocksCleared,
}
# First bytes of a msgpack array: fixarray (0x90-0x9f), array16, array32.
_ARRAY_HEADERS = frozenset([*range(0x90, 0xA0), 0xDC, 0xDD])

_SEQ = struct.Struct(">Q")
MAX_SEQ = 2**64 - 1
"""The largest sequence number the wire carries (8 unsigned bytes)."""
MAX_REPLAY_REQUEST_BYTES = 1024
"""The largest frame a publisher's replay socket takes (``ZMQ_MAXMSGSIZE``): a request is an empty
frame and 8 bytes. ZMQ drops the connection of a peer that sends more, before the frame is held.
(Without it, anyone who could reach an engine's replay port made the engine hold what it sent: a
gigabyte a message.)"""
_SIGNED_SEQ = struct.Struct(">q")
REPLAY_END_SEQ = -1
"""The sequence number of the replay end marker (encoded as 8 signed big-endian bytes)."""


def encode_batch(batch: EventBatch) -> bytes:
    """Encode a batch exactly as vLLM does: an array of three, events as ``type``-tagged maps."""
    return _encoder.encode(batch)


def _as_map_form(event: Any) -> Event:
    cls = _TO_MAP_FORM[type(event)]
    return cls(**{f: getattr(event, f) for f in event.__struct_fields__})  # type: ignore[no-any-return]


def _decode_event(raw: msgspec.Raw, index: int) -> Event:
    # Pick the decoder by the event's own msgpack type, so that the error names the real problem.
    is_array = len(raw) > 0 and memoryview(raw)[0] in _ARRAY_HEADERS
    try:
        if is_array:
            return _as_map_form(_array_event_decoder.decode(raw))
        return _map_event_decoder.decode(raw)  # type: ignore[no-any-return]
    except msgspec.DecodeError as e:
        raise MalformedEventError(f"malformed KV event #{index}: {e}") from None


def decode_batch(payload: bytes) -> EventBatch:
    """Decode a payload whose events are maps, arrays or a mix; raise MalformedEventError otherwise."""
    try:
        return _map_decoder.decode(payload)
    except msgspec.DecodeError:
        pass  # not all events in map form, or malformed: the slower path below tells which
    try:
        raw = _raw_decoder.decode(payload)
    except msgspec.DecodeError as e:
        raise MalformedEventError(f"malformed KV-event payload: {e}") from None
    events = [_decode_event(r, i) for i, r in enumerate(raw.events)]
    return EventBatch(raw.ts, events, raw.data_parallel_rank)


def pack_seq(seq: int) -> bytes:
    return _SEQ.pack(seq)


def unpack_seq(frame: bytes) -> int:
    """Read a sequence frame: u64 big-endian, except the replay end marker (-1, signed)."""
    if len(frame) != 8:
        raise MalformedEventError(f"sequence frame must be 8 bytes, got {len(frame)}")
    if frame == b"\xff" * 8:
        return REPLAY_END_SEQ
    return int(_SEQ.unpack(frame)[0])


def pack_frames(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    return [topic, _SEQ.pack(seq), payload]


def end_marker_frames() -> list[bytes]:
    """The replay socket's last answer: empty topic, seq -1 (signed), empty payload."""
    return [b"", _SIGNED_SEQ.pack(REPLAY_END_SEQ), b""]


def unpack_frames(frames: list[bytes]) -> tuple[bytes, int, bytes]:
    """Split a PUB message into ``(topic, seq, payload)``; raise MalformedEventError on a bad shape."""
    if len(frames) != 3:
        raise MalformedEventError(f"KV-event message must have 3 frames, got {len(frames)}")
    topic, seq, payload = frames
    return bytes(topic), unpack_seq(bytes(seq)), bytes(payload)


def event_to_json(event: Event) -> dict[str, Any]:
    """A JSON-ready dict of an event; bytes hashes become hex strings."""

    def h(x: EngineHashT | None) -> int | str | None:
        return x.hex() if isinstance(x, bytes) else x

    if isinstance(event, BlockStored):
        return {
            "type": "BlockStored",
            "block_hashes": [h(x) for x in event.block_hashes],
            "parent_block_hash": h(event.parent_block_hash),
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_name": event.adapter,
            "medium": event.medium or None,
        }
    if isinstance(event, BlockRemoved):
        return {
            "type": "BlockRemoved",
            "block_hashes": [h(x) for x in event.block_hashes],
            "medium": event.medium or None,
        }
    return {"type": "AllBlocksCleared"}
