"""Predict-on-route: the event index, plus a short-TTL record of the router's own decisions.

KV events lag a decision by the prefill time, so a burst of requests sharing a new prefix would
spread over the fleet before the first worker's ``BlockStored`` arrives. Each decision is recorded
in an approximate index for a few seconds, and a query answers, per worker, the longer of the two
device-tier depths (``--router-predicted-ttl-secs``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvmesh._types import WorkerKey
from kvmesh.events.wire import BlockStored, Event
from kvmesh.router.core.approx_index import ApproxIndex
from kvmesh.router.core.chain_trie import TierDepths
from kvmesh.router.core.event_index import PrefixIndex
from kvmesh.router.core.index import IndexCounters

_NO_TIERS = TierDepths(0, 0, 0)


class PredictedIndex:
    """A ``KvIndex``: events feed ``events``, decisions feed ``predicted``, queries merge both.

    The selector's tie-break (``block_count``) counts what the engines reported, not predictions.
    """

    __slots__ = ("events", "predicted")

    def __init__(self, events: PrefixIndex, predicted: ApproxIndex) -> None:
        self.events = events
        self.predicted = predicted

    def find_matches(self, local_hashes: Sequence[int]) -> dict[WorkerKey, int]:
        out = self.events.find_matches(local_hashes)
        for key, depth in self.predicted.find_matches(local_hashes).items():
            if depth > out.get(key, 0):
                out[key] = depth
        return out

    def find_matches_tiered(self, local_hashes: Sequence[int]) -> dict[WorkerKey, TierDepths]:
        """A predicted device prefix counts as device, so it also raises the host and disk depths."""
        out = self.events.find_matches_tiered(local_hashes)
        for key, depth in self.predicted.find_matches(local_hashes).items():
            have = out.get(key, _NO_TIERS)
            if depth > have.device:
                out[key] = TierDepths(depth, max(depth, have.host), max(depth, have.disk))
        return out

    def continuation(self, local_hashes: Sequence[int], limit: int) -> list[int]:
        """What the engines reported (the blocks a decision predicts are its prompt's own)."""
        return self.events.continuation(local_hashes, limit)

    def block_count(self, worker: WorkerKey) -> int:
        return self.events.block_count(worker)

    def apply(self, worker: WorkerKey, events: Iterable[Event]) -> None:
        self.events.apply(worker, events)

    def load_stored(self, worker: WorkerKey, events: Iterable[BlockStored]) -> None:
        self.events.load_stored(worker, events)

    def clear_worker(self, worker: WorkerKey) -> None:
        """Only the event side: the predictions are the router's own and stay until their TTL."""
        self.events.clear_worker(worker)

    def record(self, worker: WorkerKey, local_hashes: Sequence[int], now: float) -> None:
        self.predicted.record(worker, local_hashes, now)

    def expire(self, now: float) -> int:
        return self.predicted.expire(now)

    def forget_predicted(self, worker: WorkerKey) -> None:
        self.predicted.forget_predicted(worker)

    def remove_worker(self, worker: WorkerKey) -> None:
        self.events.remove_worker(worker)
        self.predicted.remove_worker(worker)

    def counters(self) -> IndexCounters:
        mine = self.events.counters()
        return IndexCounters(mine.events_applied, mine.event_pruned_blocks, self.predicted.pruned_blocks)
