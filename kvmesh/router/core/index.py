"""The one interface KvRouter has to its prefix index, whichever variant the config chose.

Each variant is fed one way: ``event_index.PrefixIndex`` by the workers' KV events,
``approx_index.ApproxIndex`` by the router's own decisions, ``predicted_index.PredictedIndex`` by
both. Every variant takes every feed and ignores the ones that do not concern it (documented on the
method), so the router calls them all and never asks which kind it holds; ``index_factory`` is the
one place that chooses. The contract suite (tests/router/core/test_index.py) runs over all of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvmesh._types import WorkerKey
from kvmesh.events.wire import BlockStored, Event
from kvmesh.router.core.chain_trie import TierDepths


@dataclass(frozen=True, slots=True)
class IndexCounters:
    """What an index has counted since it was built (for ``KvRouter.stats``)."""

    events_applied: dict[tuple[str, str], int]
    """(event type, status) -> count; empty for an index no event feeds."""
    event_pruned_blocks: int
    """Entries the event index dropped to stay within its entry budget."""
    approx_pruned_blocks: int
    """Entries an approximate index dropped to stay within its size cap (before their TTL)."""


class KvIndex(Protocol):
    """Which worker holds how much of a prompt's prefix, and the feeds that keep that current."""

    # ---------------------------------------------------------------- queries
    def find_matches(self, local_hashes: Sequence[int]) -> dict[WorkerKey, int]:
        """Each worker's longest consecutive device-tier prefix of the query (workers with >0 only)."""
        ...

    def find_matches_tiered(self, local_hashes: Sequence[int]) -> dict[WorkerKey, TierDepths]:
        """Device, device-or-host and any-tier prefix depths per worker (any level > 0 only)."""
        ...

    def continuation(self, local_hashes: Sequence[int], limit: int) -> list[int]:
        """Up to ``limit`` hashes of the blocks that follow the whole query one way only."""
        ...

    def block_count(self, worker: WorkerKey) -> int:
        """Blocks indexed for a worker (the selector's tie-break, and snapshots)."""
        ...

    # ---------------------------------------------------------------- fed by KV events
    def apply(self, worker: WorkerKey, events: Iterable[Event]) -> None:
        """Apply one batch of a worker's KV events."""
        ...

    def load_stored(self, worker: WorkerKey, events: Iterable[BlockStored]) -> None:
        """Cold start: replace what the worker's events said with these stored blocks."""
        ...

    def clear_worker(self, worker: WorkerKey) -> None:
        """The worker's event stream was reset: forget what its events said."""
        ...

    # ---------------------------------------------------------------- fed by routing decisions
    def record(self, worker: WorkerKey, local_hashes: Sequence[int], now: float) -> None:
        """The router sent this prefix to ``worker`` at ``now``."""
        ...

    def expire(self, now: float) -> int:
        """Drop entries whose time is up; returns how many."""
        ...

    def forget_predicted(self, worker: WorkerKey) -> None:
        """The worker's cache was emptied (a flush the router asked for): forget what its own
        decisions predicted there. What the worker's events said, its events clear."""
        ...

    # ---------------------------------------------------------------- either
    def remove_worker(self, worker: WorkerKey) -> None:
        """The worker left the fleet: forget everything about it."""
        ...

    def counters(self) -> IndexCounters: ...
