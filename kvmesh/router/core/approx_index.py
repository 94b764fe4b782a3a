"""Approximate index: the chain trie fed by the router's own decisions, each entry with a TTL.

No engine tells this index anything: a routed request's prefix is assumed cached on the chosen
worker until ``ttl`` seconds after it was last routed there.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvmesh._types import WorkerKey
from kvmesh.events.wire import BlockStored, Event
from kvmesh.router.core.chain_trie import ROOT, ChainIndex
from kvmesh.router.core.index import IndexCounters


class ApproxIndex(ChainIndex):
    """What the router itself routed, each block living ``ttl`` seconds after its last routing.

    Used instead of the event index with ``--no-router-kv-events``, and beside it (short TTL) for
    predict-on-route. Size is capped at ``max_blocks`` (worker, block) entries; beyond that the
    earliest-expiring entries go first until ``prune_target_ratio * max_blocks`` remain.
    """

    def __init__(
        self, *, ttl: float = 120.0, max_blocks: int = 2**20, prune_target_ratio: float = 0.8
    ) -> None:
        super().__init__()
        self.ttl = ttl
        self.max_blocks = max_blocks
        self.prune_target_ratio = prune_target_ratio
        # (handle << 10 | slot) -> expiry; insertion order is expiry order because ttl is fixed and
        # ``now`` never goes back (a refresh moves the entry to the end).
        self._expiry: dict[int, float] = {}
        self.pruned_blocks = 0
        self.expired_blocks = 0

    def record(self, worker: WorkerKey, local_hashes: Sequence[int], now: float) -> None:
        """Remember that ``worker`` now holds this prefix (refreshing the TTL of known blocks)."""
        if not local_hashes:
            return
        slot = self._slot(worker)
        if slot >= 1024:
            raise ValueError("the approximate index supports at most 1024 (worker, dp_rank) slots")
        expiry = self._expiry
        until = now + self.ttl
        for h in self._insert_run(ROOT, local_hashes, slot, 0, dup_ok=False):
            k = (h << 10) | slot
            expiry.pop(k, None)
            expiry[k] = until
        if len(expiry) > self.max_blocks:
            self._prune(int(self.max_blocks * self.prune_target_ratio))

    def _drop(self, k: int) -> None:
        self._remove(k & 1023, 0, k >> 10)

    def expire(self, now: float) -> int:
        """Drop entries whose TTL has passed; returns how many."""
        expiry = self._expiry
        gone = 0
        while expiry:
            k = next(iter(expiry))
            if expiry[k] > now:
                break
            del expiry[k]
            self._drop(k)
            gone += 1
        self.expired_blocks += gone
        return gone

    def _prune(self, target: int) -> None:
        expiry = self._expiry
        while len(expiry) > target:
            k = next(iter(expiry))
            del expiry[k]
            self._drop(k)
            self.pruned_blocks += 1

    def remove_worker(self, worker: WorkerKey) -> None:
        slot = self._slot_of.get(worker)
        if slot is None:
            return
        mine = [k for k in self._expiry if k & 1023 == slot]
        depth_of = self._depth_of
        mine.sort(key=lambda k: depth_of(k >> 10), reverse=True)  # children first
        for k in mine:
            del self._expiry[k]
            self._drop(k)
        self._release_slot(slot)

    def forget_predicted(self, worker: WorkerKey) -> None:
        """Everything recorded for the worker goes: its cache is empty."""
        self.remove_worker(worker)

    def clear(self) -> None:
        for worker in list(self._slot_of):
            self.remove_worker(worker)

    @property
    def size(self) -> int:
        return len(self._expiry)

    def counters(self) -> IndexCounters:
        return IndexCounters({}, 0, self.pruned_blocks)

    # ------------------------------------------------------------------ KV events (KvIndex)
    # No engine feeds this index: it is used where there are no KV events, or beside the event index.
    def apply(self, worker: WorkerKey, events: Iterable[Event]) -> None:
        """Ignored: this index learns from routing decisions only."""

    def load_stored(self, worker: WorkerKey, events: Iterable[BlockStored]) -> None:
        """Ignored: this index learns from routing decisions only."""

    def clear_worker(self, worker: WorkerKey) -> None:
        """Ignored: a reset of the worker's event stream says nothing about what was routed there."""
