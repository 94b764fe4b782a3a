"""KvRouter: the object that ties the prefix index, load model, selector, queue and sessions.

Pure: no I/O, no clock, no global randomness. Every call that depends on time takes ``now``
(seconds, any monotonic origin) and randomness comes from the ``random.Random`` given at
construction, so a test can replay a run exactly.

A request's life, as the middleware drives it::

    route(req, now) ─┬─> Decision  ─> first_token() ─> output_tokens()* ─> finished() | cancel()
                     ├─> Queued    ─> release(now) later returns its Decision (or cancel())
                     └─> Rejected  (busy, queue full, unknown worker, no workers)

Every Decision is already counted as load on its worker; feedback calls undo it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from kvmesh._types import DpRank, WorkerId, WorkerKey
from kvmesh.events.wire import BlockStored, EventBatch
from kvmesh.router.config import RouterConfig

if TYPE_CHECKING:
    import random

SessionAction = Literal["open", "close", "bind"]
RejectReason = Literal["busy", "queue_full", "unknown_worker", "no_workers", "no_target"]
DecisionReason = Literal["kv", "pinned", "session", "round-robin", "random", "direct"]


@dataclass(slots=True)
class RouteRequest:
    """What the router needs to know about one request (the middleware builds it from the body)."""

    request_id: str
    local_hashes: Sequence[int]
    """Per-block local hashes of the prompt (``kvmesh.hashing.block_hashes``; full blocks only)."""
    isl_tokens: int
    """Prompt length in tokens (may exceed ``len(local_hashes) * block_size``: a partial block)."""
    arrival: float = 0.0
    lora_name: str | None = None
    backend_instance_id: WorkerId | None = None
    """Explicit pin (``nvext.backend_instance_id`` / ``x-worker-instance-id``): skip the cost model."""
    dp_rank: DpRank | None = None
    """With a pin: a specific data-parallel rank; None lets the router pick the rank."""
    priority: float | None = None
    """``agent_hints.priority`` (higher = more important); queue jump ``max(priority, 0)``."""
    latency_sensitivity: float | None = None
    """``agent_hints.latency_sensitivity`` in seconds; the queue jump when no priority is given."""
    osl: int | None = None
    """``agent_hints.osl``: expected output tokens, used for output-block decay."""
    overlap_score_credit: float | None = None
    """``agent_hints.kv_overlap_score_credit``: per-request override of the overlap credit."""
    session_id: str | None = None
    session_action: SessionAction | None = None
    session_timeout: float | None = None
    allowed_workers: frozenset[WorkerId] | None = None
    """Restrict candidates (e.g. healthy workers only); None means every registered worker."""


@dataclass(frozen=True, slots=True)
class CandidateScore:
    """One candidate's numbers behind a decision (kept for metrics and ``/kvmesh/workers`` debugging)."""

    worker: WorkerKey
    overlap_blocks: int
    """Device-tier prefix blocks cached on this worker (max of event index and predicted index)."""
    host_blocks: int
    """Further prefix blocks held in host memory beyond the device prefix."""
    disk_blocks: int
    """Further prefix blocks on disk / external storage beyond the host prefix."""
    prefill_tokens: float
    """Projected prefill tokens: active prefill tokens + this request's uncredited tokens."""
    prefill_blocks: float
    """``prefill_tokens / block_size`` (what the cost weighs with ``prefill_load_scale``)."""
    decode_blocks: float
    """Projected decode blocks: active blocks + this request's blocks not already active."""
    cost: float
    busy: bool = False


@dataclass(frozen=True, slots=True)
class Decision:
    request_id: str
    worker: WorkerKey
    overlap_blocks: int
    """Device prefix blocks the chosen worker is expected to have cached."""
    cached_tokens: int
    """``overlap_blocks * block_size`` capped at the prompt length (compare with engine usage)."""
    reason: DecisionReason
    breakdown: tuple[CandidateScore, ...] = ()
    waited: float = 0.0
    """Seconds the request spent in the admission queue."""


@dataclass(frozen=True, slots=True)
class Queued:
    request_id: str
    position: int
    """0-based rank in the queue order at the time of queueing."""
    pending: int
    """Requests waiting, this one included."""


@dataclass(frozen=True, slots=True)
class Rejected:
    request_id: str
    reason: RejectReason
    message: str
    retry_after: float | None = None
    """Seconds for an HTTP ``Retry-After`` header (busy / queue full), else None."""


RouteResult = Decision | Queued | Rejected


@dataclass(frozen=True, slots=True)
class ExpiredSession:
    session_id: str
    worker: WorkerKey


@dataclass(frozen=True, slots=True)
class BusyThresholds:
    active_decode_blocks_threshold: float | None = None
    active_prefill_tokens_threshold: int | None = None
    active_prefill_tokens_threshold_frac: float | None = None


@dataclass(frozen=True, slots=True)
class WorkerSnapshot:
    worker: WorkerKey
    active_prefill_tokens: int
    active_decode_blocks: float
    active_requests: int
    indexed_blocks: int
    total_blocks: int
    max_num_batched_tokens: int
    busy: bool


@dataclass(slots=True)
class RouterStats:
    """Counters for metrics; read them, never reset them."""

    events_applied: dict[tuple[str, str], int] = field(default_factory=dict)
    """(event type, status) -> count; status in ok / parent_not_found / block_not_found."""
    index_pruned_blocks: int = 0
    approx_pruned_blocks: int = 0
    requests_expired: int = 0
    queue_rejected: int = 0


_UNSET: object = object()


class KvRouter:
    """The routing brain. Not thread-safe: call it from one event loop."""

    def __init__(self, config: RouterConfig, rng: random.Random) -> None:
        raise NotImplementedError

    # ---------------------------------------------------------------- fleet
    def add_worker(
        self,
        worker_id: WorkerId,
        *,
        dp_size: int = 1,
        total_blocks: int,
        max_num_batched_tokens: int,
        block_size: int,
    ) -> None:
        """Register a worker with ``dp_size`` schedulable ranks. Re-adding updates its limits."""
        raise NotImplementedError

    def remove_worker(self, worker_id: WorkerId) -> list[ExpiredSession]:
        """Forget a worker: its index state, load and in-flight requests; returns its sessions."""
        raise NotImplementedError

    @property
    def workers(self) -> list[WorkerKey]:
        raise NotImplementedError

    # ---------------------------------------------------------------- KV state
    def apply_events(self, worker_id: WorkerId, batch: EventBatch) -> None:
        """Apply one engine batch (dp rank from ``batch.data_parallel_rank``, None -> 0)."""
        raise NotImplementedError

    def load_state(self, worker_id: WorkerId, dp_rank: DpRank, events: Sequence[BlockStored]) -> None:
        """Cold start: replace the rank's index state with these stored events (parents first)."""
        raise NotImplementedError

    def clear_worker_index(self, worker_id: WorkerId, dp_rank: DpRank | None = None) -> None:
        """Drop index state (subscriber reset: the stream could not be recovered)."""
        raise NotImplementedError

    # ---------------------------------------------------------------- routing
    def route(self, req: RouteRequest, now: float) -> RouteResult:
        """Decide, queue or refuse. A Decision is counted as load immediately."""
        raise NotImplementedError

    def release(self, now: float) -> list[Decision]:
        """Queued requests that may go now (call after feedback frees capacity, or on a timer)."""
        raise NotImplementedError

    def track(
        self,
        request_id: str,
        worker: WorkerKey,
        local_hashes: Sequence[int],
        isl_tokens: int,
        now: float,
        *,
        overlap_blocks: int = 0,
        osl: int | None = None,
    ) -> None:
        """Count a request routed elsewhere (a peer replica's decision) as load on ``worker``."""
        raise NotImplementedError

    # ---------------------------------------------------------------- feedback
    def first_token(self, request_id: str, now: float) -> None:
        """Prefill is done: its prompt tokens stop counting as prefill load."""
        raise NotImplementedError

    def output_tokens(self, request_id: str, n: int, now: float) -> None:
        """``n`` more tokens were generated (output-block tracking, and liveness)."""
        raise NotImplementedError

    def finished(self, request_id: str, now: float) -> None:
        """The stream ended: free the request's load. Unknown ids are ignored."""
        raise NotImplementedError

    def cancel(self, request_id: str, now: float) -> bool:
        """Client gone: drop a queued request or free an in-flight one. True if it was known."""
        raise NotImplementedError

    def expire(self, now: float) -> list[ExpiredSession]:
        """Housekeeping: expire idle sessions (returned, so engine sessions can be closed),
        in-flight requests whose finish never came, and approximate-index blocks past their TTL."""
        raise NotImplementedError

    # ---------------------------------------------------------------- runtime knobs / views
    def busy_thresholds(self) -> BusyThresholds:
        raise NotImplementedError

    def set_busy_thresholds(
        self,
        *,
        active_decode_blocks_threshold: float | object | None = _UNSET,
        active_prefill_tokens_threshold: int | object | None = _UNSET,
        active_prefill_tokens_threshold_frac: float | object | None = _UNSET,
    ) -> BusyThresholds:
        """Change the busy thresholds at runtime (omitted ones stay; None turns one off)."""
        raise NotImplementedError

    def worker_snapshot(self) -> list[WorkerSnapshot]:
        raise NotImplementedError

    @property
    def stats(self) -> RouterStats:
        raise NotImplementedError

    @property
    def queue_pending(self) -> tuple[int, int]:
        """(requests, prompt tokens) waiting in the admission queue."""
        raise NotImplementedError
