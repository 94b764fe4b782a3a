"""What ``KvRouter.route()`` takes and gives back, and what its views show.

A :class:`RouteRequest` goes in; a :class:`Decision` (with every candidate's
:class:`CandidateScore`), a :class:`Queued` or a :class:`Rejected` comes out. The views
(:class:`WorkerSnapshot`, :class:`RouterStats`, :class:`TimingSample`) and the
:class:`RoutingObserver` hook are the router's other faces. Data only: the logic that fills them is in
:mod:`~kvmesh.router.core.kv_router`, :mod:`~kvmesh.router.core.latency_cost` and
:mod:`~kvmesh.router.core.observations`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from kvmesh._types import DpRank, WorkerId, WorkerKey

SessionAction = Literal["open", "close", "bind"]
RejectReason = Literal["busy", "queue_full", "unknown_worker", "no_workers", "no_target", "session_limit"]
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
    """``agent_hints.osl``: expected output tokens; its answer blocks count as decode load from routing."""
    overlap_score_credit: float | None = None
    """``agent_hints.kv_overlap_score_credit``: per-request override of the overlap credit."""
    prefill_load_scale: float | None = None
    """Per-request prefill load scale (the older ``agent_hints.kv_overlap_score_weight``)."""
    session_id: str | None = None
    session_action: SessionAction | None = None
    session_timeout: float | None = None
    allowed_workers: frozenset[WorkerId] | None = None
    """Restrict candidates (e.g. healthy workers only); None means every registered worker."""
    client: str | None = None
    """Who sent it (the client address): the owner of a session it opens, for the per-client limit."""
    estimated_blocks: int = 0
    """Blocks of a prompt routed before all its hashes are known, when more than ``local_hashes``
    holds: ``local_hashes`` empty where no worker held its first block, or the blocks of the
    conversation's earlier turn it begins with. The front tokenizes it once it is sent, then calls
    ``KvRouter.amend``; until then the load counts the blocks beyond the known ones as new.
    Latency cost only."""
    copies_in_background: bool = False
    """The front can copy a shared prefix to another worker by a prefill of its own (a token-id
    ``/v1/completions`` request, :mod:`kvmesh.router.asgi.prefix_copy`): where the latency cost
    would copy this request's shared prefix by sending the request itself to a worker that does
    not hold it, it goes where it is fastest and the decision names the copy to make
    (``Decision.copy``). False for prompts whose cache is keyed by more than their tokens, which
    such a prefill would not reproduce."""
    prefilled_elsewhere: bool = False
    """The decode stage of a disaggregated request: another worker computes its prompt and the KV
    arrives by transfer, so a candidate adds no prefill work for it; its load decides, and among
    equally loaded candidates the one holding most of the prompt (the least KV to move)."""
    reads_no_cache: bool = False
    """The engine computes this prompt whole, reading none of its cached prefix (vLLM, for a
    request with prompt logprobs: ``kvmesh.router.request.parse.prompt_recomputed``): no worker
    holds any of it for the cost, the load or the prediction of cached tokens. Its blocks are
    cached once computed, as any other request's."""


@dataclass(slots=True)  # not frozen: a frozen one sets each field through object.__setattr__, ~8x slower
class CandidateScore:
    """One candidate's numbers behind a decision (kept for metrics and ``/kvmesh/workers`` debugging).
    Every candidate of every decision builds one; nothing changes it afterwards."""

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
    predicted_ttft_ms: float | None = None
    """The latency cost's predicted time to first token (None with Dynamo's cost)."""
    eviction_ms: float = 0.0
    """The latency cost's price for live cache this request would evict there."""
    step_wait_ms: float = 0.0
    """The latency cost's wait for the step running there before this request's can start: the rest
    of a prefill step (see ``ActiveSequences.step_in_progress``), or of the decode pass in progress
    (see :mod:`~kvmesh.router.core.pass_lag`); 0 on an idle worker."""
    copy_credit_ms: float = 0.0
    """The latency cost's credit for copying a shared prefix here: the wait the copy saves the
    requests that will share it (:mod:`kvmesh.router.core.copies`), taken off the cost."""
    delay_to_others_ms: float = 0.0
    """The latency cost's delay to others: the time to first token this request would take from
    the requests arriving on this worker while it is there, at the rate the requests in flight there
    imply (Little's law; half its prefill for those arriving during it; one and a half longer decode passes for those
    arriving during its decode). Replaced a flat "its prefill time, as if one request waited
    behind it", which made a worker already taking most of a hot prefix's traffic look as cheap as
    an idle one and piled the prefix onto it (all 376 hot-prefix requests on one of 8 engines,
    TTFT p50 1.6x Dynamo's cost). Also measured and dropped: charging the prefill's stall to every
    request decoding there (time between tokens, not to a first token: it spread a hot prefix and
    recomputed it, TTFT p50 1.8x, hits 0.84 vs 0.91)."""
    turns_overlap_ms: float = 0.0
    """The latency cost's price for this conversation's later turns and those of the conversations
    living on this worker finding each other in flight there (see ``LatencyCost.turns_overlap_ms``)."""
    memory_wait_ms: float = 0.0
    """The latency cost's wait for KV blocks there (part of ``predicted_ttft_ms``): the blocks in
    flight there and this request's are past the worker's cache (see ``LatencyCost.memory_wait_ms``)."""


@dataclass(frozen=True, slots=True)
class PrefixCopy:
    """A shared prefix to prefill on a worker that does not hold it, for the requests to come."""

    worker: WorkerKey
    blocks: int
    """The prefix's length: the request's first ``blocks`` blocks."""


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
    copy: PrefixCopy | None = None
    """A copy of the request's shared prefix for the front to make in the background, or None."""


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
    timing: dict[str, Any] | None = None
    """The worker's fitted timing model (coefficients, prediction error), when it has one."""
    live_blocks: int = 0
    """Blocks of the conversations living there (the latency cost's view; 0 with Dynamo's)."""
    unseen_requests: float = 0.0
    """Requests the engine last reported beyond the router's own (:meth:`KvRouter.engine_load`)."""
    decode_s: float | None = None
    """The learned time from a request's first token to its finish there (None: none finished)."""
    in_system_s: float | None = None
    """The learned time from dispatch to finish there, the queue and the wait for memory
    included: what the requests in flight are divided by for their arrival rate."""


@dataclass(frozen=True, slots=True)
class TimingSample:
    """One finished request: the TTFT the router predicted at dispatch, and the one observed."""

    worker: WorkerKey
    predicted_s: float
    observed_s: float


@dataclass(slots=True)
class RouterStats:
    """Counters for metrics; read them, never reset them."""

    events_applied: dict[tuple[str, str], int] = field(default_factory=dict)
    """(event type, status) -> count; status in ok / parent_not_found / block_not_found."""
    index_pruned_blocks: int = 0
    approx_pruned_blocks: int = 0
    requests_expired: int = 0
    queue_rejected: int = 0


class RoutingObserver(Protocol):
    """Hears of this router's decisions (``route()`` / ``release()``; of ``track()`` only with
    ``own=True``, the requests it makes itself), and of every first token and load release,
    whichever way the request was counted: an observer that only cares about its own decisions
    filters those by request id."""

    def routed(
        self,
        request_id: str,
        worker: WorkerKey,
        local_hashes: Sequence[int],
        isl_tokens: int,
        overlap_blocks: int,
        osl: int | None,
    ) -> None: ...

    def prefill_done(self, request_id: str) -> None: ...

    def freed(self, request_id: str) -> None: ...

    def session(self, session_id: str, worker: WorkerKey | None, timeout: float) -> None:
        """A session was bound or used (``worker``, sliding its expiry by ``timeout``) or closed
        (``worker`` None), so every replica honours one affinity."""
        ...
