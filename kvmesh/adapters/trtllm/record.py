"""The bridge's own record of what one attention-DP rank has cached: for kv_state, and for pins.

TensorRT-LLM has no call that lists its cached blocks or looks a prompt up in its radix tree, so
everything kvmesh knows about the cache comes from the events the bridge published. Two views of
the same events:

* :class:`~kvmesh.worker.block_state.CachedBlockState`: the published blocks, dumped as
  ``BlockStored`` events for ``/kvmesh/kv_state`` (the same shape every backend answers);
* a prefix lookup ``(parent key, block tokens) -> key``: a pin names a token prefix, and walking
  it block by block from the root finds the cached blocks it covers, exactly as the engine's
  radix tree would reuse them (a block is only reachable through its parent).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from kvmesh.events.wire import AllBlocksCleared, BlockRemoved, BlockStored, Event
from kvmesh.worker.block_state import CachedBlockState

__all__ = ["RankRecord"]

_Edge = tuple[int | None, tuple[Any, ...]]


class RankRecord:
    """Published cached blocks of one rank, with a prefix lookup by tokens."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.state = CachedBlockState()
        self._child: dict[_Edge, int] = {}
        self._edge: dict[int, _Edge] = {}

    def apply(self, events: Iterable[Event]) -> None:
        events = list(events)
        self.state.apply(events)
        size = self.block_size
        for event in events:
            if isinstance(event, BlockStored):
                parent = event.parent_block_hash
                for i, key in enumerate(event.block_hashes):
                    assert isinstance(key, int)
                    block_tokens = event.token_ids[i * size : (i + 1) * size]
                    edge = (parent if isinstance(parent, int) else None, tuple(block_tokens))
                    self._child[edge] = key
                    self._edge[key] = edge
                    parent = key
            elif isinstance(event, BlockRemoved):
                for key in event.block_hashes:
                    edge = self._edge.pop(key, None)  # type: ignore[arg-type]
                    if edge is not None and self._child.get(edge) == key:
                        del self._child[edge]
            elif isinstance(event, AllBlocksCleared):
                self._child.clear()
                self._edge.clear()

    def cached_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """Keys of the cached blocks that ``token_ids`` reuses from the start, head first."""
        size = self.block_size
        keys: list[int] = []
        parent: int | None = None
        for start in range(0, len(token_ids) - size + 1, size):
            key = self._child.get((parent, tuple(token_ids[start : start + size])))
            if key is None:
                break
            keys.append(key)
            parent = key
        return keys

    def tokens_of(self, key: int) -> tuple[int, ...] | None:
        edge = self._edge.get(key)
        return None if edge is None else edge[1]
