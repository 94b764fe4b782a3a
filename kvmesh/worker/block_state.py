"""The set of blocks an engine holds in its prefix cache, rebuilt from its own KV events.

An engine publishes deltas (stored / removed / cleared); a router that starts late, or that lost
more batches than the replay buffer keeps, needs the *current* set instead. :class:`CachedBlockState`
applies the same batches the publisher sends and can dump them back as ``BlockStored`` events,
parents before children, together with the sequence number of the last batch applied: a router
loads the dump and resumes the live stream right after that sequence.

Engine-agnostic: it only reads kvmesh's wire structs. Blocks are keyed by ``(group, hash)`` so
that hybrid models, whose KV-cache groups publish the same hash once per group, keep one entry
per group exactly as their events describe them. A hash stored twice without a removal in between
counts twice: vLLM caches a second physical block under the same hash when it recomputes the last
block of a fully cached prompt, and removes (and reports) each copy separately, so the hash stays
cached until its last copy goes. (vLLM's opt-in ``kv_cache_report_mode="full"`` re-announces reused
blocks without a matching removal; this state would then keep them too long.)

:func:`rank_state` and :func:`kv_state_answer` give every backend's ``/kvmesh/kv_state`` answer the
same shape, whether its cached set comes from this state (the vLLM adapter) or from its own pool
(the mock engine).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import repeat
from typing import Any

from kvmesh.events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineHashT,
    Event,
    TokenT,
    event_to_json,
)

__all__ = ["CachedBlockState", "kv_state_answer", "rank_state"]

_Key = tuple[int, EngineHashT]


@dataclass(frozen=True, slots=True)
class _Block:
    parent: EngineHashT | None
    token_ids: tuple[TokenT, ...]
    block_size: int
    lora_id: Any
    medium: Any
    lora_name: Any
    group_idx: Any

    def same_run(self, other: _Block) -> bool:
        """Whether ``other`` may share one BlockStored event with this block."""
        return (
            self.block_size == other.block_size
            and self.lora_id == other.lora_id
            and self.medium == other.medium
            and self.lora_name == other.lora_name
            and self.group_idx == other.group_idx
        )


def _group(event: BlockStored | BlockRemoved) -> int:
    g = event.group_idx
    return g if isinstance(g, int) else 0


class CachedBlockState:
    """What an engine has cached, as its events say; dumpable as BlockStored events."""

    def __init__(self) -> None:
        self._blocks: dict[_Key, _Block] = {}
        self._copies: dict[_Key, int] = {}  # extra copies of a key beyond the first

    def __len__(self) -> int:
        return len(self._blocks)

    def hashes(self, group: int = 0) -> set[EngineHashT]:
        return {h for g, h in self._blocks if g == group}

    def apply(self, events: Iterable[Event]) -> None:
        blocks = self._blocks
        copies = self._copies
        for event in events:
            if isinstance(event, BlockStored):
                group = _group(event)
                size = event.block_size
                tokens = event.token_ids
                parent = event.parent_block_hash
                for i, engine_hash in enumerate(event.block_hashes):
                    key = (group, engine_hash)
                    if key in blocks:
                        copies[key] = copies.get(key, 0) + 1
                    blocks[key] = _Block(
                        parent=parent,
                        token_ids=tuple(tokens[i * size : (i + 1) * size]),
                        block_size=size,
                        lora_id=event.lora_id,
                        medium=event.medium,
                        lora_name=event.lora_name,
                        group_idx=event.group_idx,
                    )
                    parent = engine_hash
            elif isinstance(event, BlockRemoved):
                group = _group(event)
                for engine_hash in event.block_hashes:
                    key = (group, engine_hash)
                    extra = copies.get(key)
                    if extra:
                        copies[key] = extra - 1
                    else:
                        copies.pop(key, None)
                        blocks.pop(key, None)
            elif isinstance(event, AllBlocksCleared):
                self.clear()

    def clear(self) -> None:
        self._blocks.clear()
        self._copies.clear()

    def dump(self) -> list[BlockStored]:
        """The cached blocks as BlockStored events, every parent before its children; a chain of
        blocks with equal metadata becomes one event. A block whose parent is no longer cached
        (evicted first) starts a chain and keeps its parent's hash, exactly as the engine said. A
        block cached more than once appears once more per extra copy."""
        out: list[BlockStored] = []
        run: list[tuple[EngineHashT, _Block]] = []
        for key, block in self._walk():
            if run and block.parent == run[-1][0] and run[-1][1].same_run(block):
                run.append((key[1], block))
                continue
            if run:
                out.append(_as_event(run))
            run = [(key[1], block)]
        if run:
            out.append(_as_event(run))
        # Extra copies last (their parents are out by then), once each: a router that loads the
        # dump then needs as many removals as the engine will send before the block goes.
        for key, extra in self._copies.items():
            if extra:
                out.extend(repeat(_as_event([(key[1], self._blocks[key])]), extra))
        return out

    def _walk(self) -> Iterator[tuple[_Key, _Block]]:
        """Depth-first from every block whose parent is not cached, in insertion order."""
        blocks = self._blocks
        children: dict[_Key, list[_Key]] = {}
        roots: list[_Key] = []
        for key, block in blocks.items():
            parent_key = (key[0], block.parent) if block.parent is not None else None
            if parent_key is not None and parent_key in blocks:
                children.setdefault(parent_key, []).append(key)
            else:
                roots.append(key)
        stack = list(reversed(roots))
        while stack:
            key = stack.pop()
            yield key, blocks[key]
            stack.extend(reversed(children.get(key, ())))


def _as_event(run: list[tuple[EngineHashT, _Block]]) -> BlockStored:
    first = run[0][1]
    tokens: list[TokenT] = []
    for _, block in run:
        tokens.extend(block.token_ids)
    return BlockStored(
        block_hashes=[h for h, _ in run],
        parent_block_hash=first.parent,
        token_ids=tokens,
        block_size=first.block_size,
        lora_id=first.lora_id,
        medium=first.medium,
        lora_name=first.lora_name,
        group_idx=first.group_idx,
    )


def rank_state(dp_rank: int, last_seq: int | None, events: Iterable[Event]) -> dict[str, Any]:
    """One data-parallel rank's part of ``/kvmesh/kv_state``: its cached blocks as JSON events,
    parents first, and the sequence number of the last published batch they include (None before
    the first batch)."""
    return {"dp_rank": dp_rank, "last_seq": last_seq, "events": [event_to_json(e) for e in events]}


def kv_state_answer(block_size: int, ranks: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The ``/kvmesh/kv_state`` answer: the engine's block size and every rank's state, by rank."""
    return {"block_size": block_size, "ranks": sorted(ranks, key=lambda r: int(r["dp_rank"]))}
