"""Admission queue: hold requests while every worker is saturated, release in policy order.

Keys, largest first (``jump`` = ``max(priority, 0)`` when the request has ``agent_hints.priority``,
else its ``latency_sensitivity`` in seconds, else 0):

* fcfs: ``jump - arrival``   (earliest first, a jump of j seconds overtakes j seconds of arrivals)
* lcfs: ``jump + arrival``   (latest first)
* wspt: ``(1 + jump) / max(uncached_tokens, 1)``   (Smith's rule: short and important first)

Ties keep insertion order. The queue is bounded: ``push`` answers None when it is full, so the
caller can refuse with a clear "queue full" instead of growing without limit. Cancellation is
O(1) (lazy deletion from the heap).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any

from kvmesh.router.core.config import QueuePolicy


def jump_of(priority: float | None, latency_sensitivity: float | None) -> float:
    if priority is not None:
        return max(priority, 0.0)
    if latency_sensitivity is not None:
        return max(latency_sensitivity, 0.0)
    return 0.0


def queue_key(policy: QueuePolicy, jump: float, arrival: float, uncached_tokens: int) -> float:
    if policy == "fcfs":
        return jump - arrival
    if policy == "lcfs":
        return jump + arrival
    return (1.0 + jump) / max(uncached_tokens, 1)


@dataclass(slots=True)
class Waiting:
    request_id: str
    key: float
    arrival: float
    tokens: int
    payload: Any = field(default=None, compare=False)
    """Whatever the owner needs to dispatch it later (the request, its overlap snapshot...)."""


class AdmissionQueue:
    def __init__(self, policy: QueuePolicy = "fcfs", max_length: int = 10_000) -> None:
        self.policy = policy
        self.max_length = max_length
        self._heap: list[tuple[float, int, str]] = []
        self._live: dict[str, Waiting] = {}
        self._seq_of: dict[str, int] = {}  # heap entries of cancelled-then-requeued ids are stale
        self._seq = 0
        self._tokens = 0

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._live

    @property
    def pending_tokens(self) -> int:
        return self._tokens

    def push(self, item: Waiting) -> int | None:
        """Enqueue; returns the item's 0-based position in release order, or None if full."""
        if len(self._live) >= self.max_length or item.request_id in self._live:
            return None
        self._seq += 1
        heapq.heappush(self._heap, (-item.key, self._seq, item.request_id))
        self._live[item.request_id] = item
        self._seq_of[item.request_id] = self._seq
        self._tokens += item.tokens
        return sum(1 for w in self._live.values() if w.key > item.key)

    def peek(self) -> Waiting | None:
        self._drop_dead()
        return self._live[self._heap[0][2]] if self._heap else None

    def pop(self) -> Waiting | None:
        self._drop_dead()
        if not self._heap:
            return None
        _, _, rid = heapq.heappop(self._heap)
        item = self._live.pop(rid)
        del self._seq_of[rid]
        self._tokens -= item.tokens
        return item

    def cancel(self, request_id: str) -> Waiting | None:
        item = self._live.pop(request_id, None)
        if item is not None:
            del self._seq_of[request_id]
            self._tokens -= item.tokens
        return item

    def order(self) -> list[str]:
        """Request ids in release order (for tests and debugging)."""
        return [rid for _, seq, rid in sorted(self._heap) if self._seq_of.get(rid) == seq]

    def _drop_dead(self) -> None:
        heap = self._heap
        seq_of = self._seq_of
        while heap and seq_of.get(heap[0][2]) != heap[0][1]:
            heapq.heappop(heap)
