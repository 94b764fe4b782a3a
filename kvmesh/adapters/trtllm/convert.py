"""TensorRT-LLM's KV-cache event dicts -> kvmesh wire events, one attention-DP rank at a time.

TensorRT-LLM hands out its KV events as the dicts ``KVCacheEventSerializer`` builds
(``tensorrt_llm/_utils.py``)::

    {"event_id": n, "window_size": w, ["attention_dp_rank": r,] "data": {...}}
    data: {"type": "created", "num_blocks_per_cache_level": [gpu, host]}
          {"type": "stored", "parent_hash": h|None, "blocks": [{"type": "stored_block", "block_hash": h,
              "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": x}, ...],
              "cache_level": c, "priority": p, [newer: "lora_id", "lora_name", "cache_salt", "mm_keys"]}]}
          {"type": "removed", "block_hashes": [h, ...]}
          {"type": "updated", "block_hash": h, "cache_level": {diff}, "priority": {diff}}

:class:`EventConverter` turns them into the events vLLM publishes (``BlockStored`` /
``BlockRemoved`` / ``AllBlocksCleared``), with these rules:

* **continuity**: ``event_id`` counts 0, 1, 2, ... per attention-DP rank. A jump (events lost: the
  engine's bounded buffer overflowed, or someone else drained the queue) or a restart (back to 0)
  becomes ``AllBlocksCleared`` on that rank, so every router drops what it may no longer know;
  what follows rebuilds the index. A router's view may then lack blocks the engine still has
  (a missed hit), never hold blocks it lacks.
* **window**: with sliding-window layers the engine reports one event stream per window size;
  only the largest window (full attention, from the start-up ``created`` events) describes
  reusable prefixes, the rest is dropped.
* **full blocks only**: a stored block with fewer tokens than the block size (the prompt's tail;
  the engine never stores a prompt's last token) is not published, and neither is anything
  chained below it; its later removal is swallowed too. A block with more tokens than the block
  size, or with a token that is not a plain integer id (multimodal digests), ends the chain the
  same way.
* **hashes**: every node maps an engine hash to the same signed 64-bit key, whatever form it
  came in: an integer (TensorRT-LLM's u64 block keys) reduced mod 2**64 and read as two's
  complement, as Dynamo does; a SHA-256 hex string (``hash_algo`` ``v2_sha256``) by its first
  eight bytes, big-endian, which is how TensorRT-LLM truncates SHA-256 keys to 64 bits
  (``v2_sha256_64``), so both spellings of one block agree.
* ``updated`` (a priority or cache-level change of a block that stays cached) has no form on
  kvmesh's wire and is counted as ignored, as in Dynamo's bridge; ``created`` only sets the window
  and the capacity.

Pure: no I/O, no clock. The bridge feeds it and publishes what it returns.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kvmesh.events.wire import AllBlocksCleared, BlockRemoved, BlockStored, EngineHashT, Event, TokenT

__all__ = ["EventConverter", "event_rank", "map_hash"]

_U64 = 1 << 64
_I64_MAX = (1 << 63) - 1
_CACHE_LEVEL_MEDIUM = {0: "GPU", 1: "CPU"}


def map_hash(value: Any) -> int:
    """An engine block hash (int, or SHA-256 hex string) as the signed 64-bit key kvmesh publishes."""
    if isinstance(value, bool):
        raise TypeError(f"a block hash cannot be a bool: {value!r}")
    if isinstance(value, int):
        unsigned = value % _U64
    elif isinstance(value, str):
        text = value.removeprefix("0x")
        if len(text) < 16:
            raise ValueError(f"a hex block hash needs at least 16 digits, got {value!r}")
        unsigned = int(text[:16], 16)
    else:
        raise TypeError(f"unsupported block hash {value!r}")
    return unsigned - _U64 if unsigned > _I64_MAX else unsigned


def event_rank(event: dict[str, Any]) -> int:
    """The attention-DP rank an event dict names (0 without attention DP, which names none)."""
    return int(event.get("attention_dp_rank") or 0)


@dataclass
class _Rank:
    last_event_id: int | None = None
    suppressed: set[int] = field(default_factory=set)
    """Hashes of blocks the engine holds but kvmesh did not publish (partial, or below one)."""


class EventConverter:
    """Stateful converter for one engine (all its attention-DP ranks)."""

    def __init__(self, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self._ranks: dict[int, _Rank] = {}
        self._created_windows: set[int] = set()
        self._seen_windows: set[int] = set()
        self.capacity_blocks: dict[int, int] = {}
        """GPU blocks per rank, from the ``created`` event of the full-attention window."""
        self.bridged = 0
        """Engine events that produced wire events."""
        self.dropped: Counter[str] = Counter()
        """Engine events (or blocks) not published, by reason."""
        self.resyncs = 0
        """AllBlocksCleared emitted for an event-id gap or an engine restart."""

    @property
    def max_window(self) -> int | None:
        windows = self._created_windows or self._seen_windows
        return max(windows) if windows else None

    def rank(self, rank: int) -> _Rank:
        state = self._ranks.get(rank)
        if state is None:
            state = self._ranks[rank] = _Rank()
        return state

    def convert(self, events: Iterable[dict[str, Any]]) -> list[tuple[int, Event]]:
        out: list[tuple[int, Event]] = []
        for event in events:
            before = len(out)
            try:
                self._one(event, out)
            except (KeyError, TypeError, ValueError, AttributeError):
                self.dropped["malformed"] += 1
            if len(out) > before:
                self.bridged += 1
        return out

    # ------------------------------------------------------------------ one event
    def _one(self, event: dict[str, Any], out: list[tuple[int, Event]]) -> None:
        """Append what ``event`` becomes to ``out`` (a re-sync stays even if the rest is malformed)."""
        rank_id = event_rank(event)
        state = self.rank(rank_id)
        event_id = event.get("event_id")
        data = event.get("data")
        kind = data.get("type") if isinstance(data, dict) else None
        if isinstance(event_id, int) and not isinstance(event_id, bool):
            expected = 0 if state.last_event_id is None else state.last_event_id + 1
            if event_id != expected:
                # A restart is an id back at 0; anything else is lost events. Either way the
                # engine's cache may differ from what was published: clear, then rebuild.
                state.suppressed.clear()
                self.resyncs += 1
                out.append((rank_id, AllBlocksCleared()))
                if event_id == 0 and kind == "created":
                    self._created_windows.clear()
            state.last_event_id = event_id
        if data is None or kind is None:
            raise KeyError("data.type")
        window = event.get("window_size")
        if kind == "created":
            if window is not None:
                self._created_windows.add(int(window))
                if int(window) == self.max_window:
                    levels = data.get("num_blocks_per_cache_level") or []
                    if levels:
                        self.capacity_blocks[rank_id] = int(levels[0])
            self.dropped["created"] += 1
            return
        if window is not None:
            self._seen_windows.add(int(window))
            top = self.max_window
            if top is not None and int(window) != top:
                self.dropped["window"] += 1
                return
        if kind == "stored":
            stored = self._stored(state, data)
            if stored is not None:
                out.append((rank_id, stored))
        elif kind == "removed":
            removed = self._removed(state, data)
            if removed is not None:
                out.append((rank_id, removed))
        elif kind == "updated":
            self.dropped["updated"] += 1
        else:
            self.dropped["unknown_type"] += 1

    def _stored(self, state: _Rank, data: dict[str, Any]) -> BlockStored | None:
        raw_parent = data.get("parent_hash")
        parent = None if raw_parent is None else map_hash(raw_parent)
        blocks = data["blocks"]
        size = self.block_size
        hashes: list[EngineHashT] = []
        tokens: list[TokenT] = []
        first = blocks[0] if blocks else None
        chain_cut = parent is not None and parent in state.suppressed
        for block in blocks:
            if block.get("block_hash") is None:
                chain_cut = True
                continue
            engine_hash = map_hash(block["block_hash"])
            block_tokens = [t.get("token_id") if isinstance(t, dict) else t for t in block["tokens"]]
            plain = all(type(t) is int for t in block_tokens)
            if chain_cut or len(block_tokens) != size or not plain:
                if not chain_cut:
                    reason = "partial_block" if len(block_tokens) < size and plain else "unusable_block"
                    self.dropped[reason] += 1
                chain_cut = True
                state.suppressed.add(engine_hash)
                continue
            hashes.append(engine_hash)
            tokens.extend(int(t) for t in block_tokens)  # type: ignore[arg-type]
        if not hashes:
            return None
        assert first is not None
        lora_id = first.get("lora_id") or None
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=list(tokens),
            block_size=size,
            lora_id=lora_id,
            medium=_CACHE_LEVEL_MEDIUM.get(first.get("cache_level", 0), "GPU"),
            lora_name=first.get("lora_name") or None,
        )

    def _removed(self, state: _Rank, data: dict[str, Any]) -> BlockRemoved | None:
        published: list[EngineHashT] = []
        for raw in data["block_hashes"]:
            if raw is None:
                continue
            engine_hash = map_hash(raw)
            if engine_hash in state.suppressed:
                state.suppressed.discard(engine_hash)
                continue
            published.append(engine_hash)
        if not published:
            return None
        return BlockRemoved(block_hashes=published, medium="GPU")
