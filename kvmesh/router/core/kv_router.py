"""KvRouter: the object that ties the prefix index, load model, selector, queue and sessions.

Pure: no I/O, no clock, no global randomness. Every call that depends on time takes ``now``
(seconds, any monotonic origin) and randomness comes from the ``random.Random`` given at
construction, so a test can replay a run exactly.

A request's life, as the middleware drives it::

    route(req, now) ─┬─> Decision  ─> first_token() ─> output_tokens()* ─> finished() | cancel()
                     ├─> Queued    ─> release(now) later returns its Decision (or cancel())
                     └─> Rejected  (busy, queue full, unknown worker, no workers)

Every Decision is already counted as load on its worker; feedback calls undo it.

With the latency cost (the default) each worker has a :class:`TimingModel`: a candidate's cost is
its predicted time to first token, plus what evicting live cache would cost later (see
``_eviction_ms``). The model learns from the feedback calls: ``first_token`` gives the time from
dispatch to first token, ``output_tokens`` the gaps between tokens, ``reported_cached`` the cached
tokens the engine reported; ``finished`` turns them into one observation and returns a
:class:`TimingSample` (prediction at dispatch vs what happened) for metrics. ``first_token`` also
tells whether a request routed behind the step in progress ran in that step
(:class:`~kvmesh.router.core.joins.Joins`): such a request teaches no curve, and the cost predicts
the share of them that do.

Two optional hooks, both given by the caller so the core stays pure: a ``clock`` (any
``() -> seconds`` callable) times the prefix lookup of each ``route()`` (``last_find_matches``),
and an ``observer`` (:class:`RoutingObserver`) hears of every decision and every load release,
which is how replica sync shares them.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from kvmesh._types import DpRank, WorkerId, WorkerKey
from kvmesh.errors import WorkerError
from kvmesh.events.wire import BlockStored, EventBatch
from kvmesh.router.core import selector
from kvmesh.router.core.chain_trie import TierDepths
from kvmesh.router.core.config import RouterConfig
from kvmesh.router.core.conversations import Conversations, Turn
from kvmesh.router.core.copies import SharedPrefixes, copy_saving_ms
from kvmesh.router.core.index_factory import index_for
from kvmesh.router.core.joins import Joins
from kvmesh.router.core.load import ActiveSequences, PromptBlocks
from kvmesh.router.core.queue import AdmissionQueue, Waiting, jump_of, queue_key
from kvmesh.router.core.sessions import SessionTable
from kvmesh.router.core.timing import MOCKER_PRIOR, Predictor, Profile, TimingModel, WorkerTiming
from kvmesh.router.core.wait_spread import WaitSpread

if TYPE_CHECKING:
    import random

SessionAction = Literal["open", "close", "bind"]
RejectReason = Literal["busy", "queue_full", "unknown_worker", "no_workers", "no_target", "session_limit"]
DecisionReason = Literal["kv", "pinned", "session", "round-robin", "random", "direct"]

DECISION_HISTORY = 64
"""Decisions kept for ``GET /kvmesh/decisions``: enough to see a burst's siblings and the turns
around them placed. Each keeps its breakdown, about 0.4 kB per candidate (measured): ~200 kB for
the whole history on 8 workers, ~25 MB on 1,000."""


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
    prefilled_elsewhere: bool = False
    """The decode stage of a disaggregated request: another worker computes its prompt and the KV
    arrives by transfer, so a candidate adds no prefill work for it; its load decides, and among
    equally loaded candidates the one holding most of the prompt (the least KV to move)."""


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
    """The latency cost's wait for the prefill step running there (see ``step_in_progress``)."""
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
    living on this worker finding each other in flight there (see ``_turns_overlap_ms``)."""
    memory_wait_ms: float = 0.0
    """The latency cost's wait for KV blocks there (part of ``predicted_ttft_ms``): the blocks in
    flight there and this request's are past the worker's cache (see ``_memory_wait_ms``)."""


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
    """Hears of this router's decisions (``route()`` / ``release()``, not ``track()``), and of
    every first token and load release, whichever way the request was counted: an observer that
    only cares about its own decisions filters those by request id."""

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


_UNSET: object = object()


@dataclass(slots=True)
class _Worker:
    dp_size: int
    total_blocks: int
    max_num_batched_tokens: int
    block_size: int


@dataclass(slots=True)
class _Obs:
    """What the timing model needs from one request of ours, gathered over its life."""

    worker: WorkerKey
    dispatched: float
    ahead: float
    """Prefill tokens queued on the worker at dispatch for the step it joins (``step_in_progress``)."""
    uncached: int
    """Its own uncached tokens as predicted at dispatch (replaced by the engine's report)."""
    isl: int
    decoding: bool
    kv_usage: float
    predicted_ms: float
    past_cache: bool = False
    """The blocks in flight there, its own included, were past the worker's KV cache: it waited
    for memory before its prefill."""
    memory_wait_ms: float = 0.0
    """The wait for memory its decision predicted (0: none, or no decision scored it)."""
    step_wait_ms: float = 0.0
    """What was left of the prefill step running there at dispatch (the model's own estimate)."""
    anchor: str | None = None
    """The request taken to be in that step (None: no step was running)."""
    gap_s: float = 0.0
    """How long after that request became the step in progress this one was routed."""
    anchor_first_at: float | None = None
    """When the anchor showed its first token (None: not yet)."""
    joined: bool = False
    """It showed its first token with the anchor's: it joined that step rather than waiting it out."""
    followers: list[_Obs] | None = None
    """The requests routed behind this one's step (told its first token's time)."""
    ttft: float | None = None
    last_token: float | None = None
    cached: int | None = None
    timed: bool = True
    """False when the first token was not seen as such (a non-streamed answer arrives whole): its
    "first token" time is the whole request, which must teach neither TTFT nor decode timing."""


@dataclass(slots=True)
class _Pending:
    """What a queued request needs at release: the request and its arrival-time overlaps."""

    req: RouteRequest
    overlaps: dict[WorkerKey, TierDepths] | None
    queued_at: float


_NO_TIERS = TierDepths(0, 0, 0)
_REUSE_ALPHA = 0.05


class KvRouter:
    """The routing brain. Not thread-safe: call it from one event loop."""

    def __init__(
        self, config: RouterConfig, rng: random.Random, *, clock: Callable[[], float] | None = None
    ) -> None:
        self.config = config
        self._rng = rng
        self._clock = clock
        self.last_find_matches: float | None = None
        """Seconds the last ``route()`` spent in prefix lookups (None: none ran, or no clock)."""
        self.observer: RoutingObserver | None = None
        self._workers: dict[WorkerId, _Worker] = {}
        self._keys: list[WorkerKey] = []
        self._block_size: int | None = None
        self._index = index_for(config)
        self._load = ActiveSequences(
            block_size=16,  # replaced by the fleet's block size at the first add_worker
            assume_kv_reuse=config.router_assume_kv_reuse,
            track_prefill_tokens=config.router_track_prefill_tokens,
            track_active_blocks=config.router_track_active_blocks,
            track_output_blocks=config.router_track_output_blocks,
        )
        self._sessions = SessionTable(config.router_session_timeout_secs)
        self._queue = AdmissionQueue(config.router_queue_policy, config.router_queue_max_length)
        self._busy = BusyThresholds(
            config.active_decode_blocks_threshold,
            config.active_prefill_tokens_threshold,
            config.active_prefill_tokens_threshold_frac,
        )
        self._weights = selector.CostWeights(
            config.overlap_score_credit,
            config.host_cache_hit_weight,
            config.disk_cache_hit_weight,
            config.prefill_load_scale,
        )
        self._rr = 0
        self._stats = RouterStats()
        self._timing: dict[WorkerKey, WorkerTiming] = {}
        self._fleet_timing = TimingModel(MOCKER_PRIOR, 8192)
        """Every unprofiled worker's observations: what a worker seen little is assumed to be like."""
        self._profiles: dict[WorkerId, Profile | None] = {}
        self._obs: dict[str, _Obs] = {}
        self._reuse_fleet = 0.0
        """EWMA of the engine-reported prefix hit share over the fleet: how likely cached blocks
        are to be asked for again (what evicting them costs)."""
        self._seen_reuse = False
        self._decode_s: dict[WorkerKey, float] = {}
        """Per worker, an EWMA of a request's time from first token to finish."""
        self._decode_fleet = 0.0
        self._in_system_s: dict[WorkerKey, float] = {}
        """Per worker, an EWMA of a request's time from dispatch to finish: its whole stay, the
        queue and the wait for memory included (what Little's law divides the requests in flight
        by)."""
        self._in_system_fleet = 0.0
        self._out_tokens = 0.0
        """Output tokens a request generates, fleet-wide (moving average of finished ones)."""
        self._conversations = Conversations()
        self._joins = Joins()
        self._wait_spread = WaitSpread()
        self._shared = SharedPrefixes()
        self._copies = 0
        """Requests placed on a worker that did not hold the shared prefix they carry: copies made."""
        self._latency = config.router_cost_model == "latency"
        self._aic = config.router_prefill_load_model == "aic"
        self._recent: deque[tuple[float, Decision]] = deque(maxlen=DECISION_HISTORY)
        """The last decisions, oldest first, with the time each was made."""

    # ---------------------------------------------------------------- fleet
    def add_worker(
        self,
        worker_id: WorkerId,
        *,
        dp_size: int = 1,
        total_blocks: int,
        max_num_batched_tokens: int,
        block_size: int,
        profile: Profile | None = None,
    ) -> None:
        """Register a worker with ``dp_size`` schedulable ranks. Re-adding updates its limits.

        ``profile`` (a worker's reported step-time curve) seeds its timing model; without one the
        reference mocker's fit does. A model that already learned is kept across re-adds."""
        if dp_size < 1 or block_size < 1:
            raise WorkerError(f"worker {worker_id}: dp_size and block_size must be >= 1")
        if self._block_size is None:
            self._block_size = block_size
            self._load.block_size = block_size
        elif block_size != self._block_size:
            raise WorkerError(
                f"worker {worker_id} uses block size {block_size}, the fleet uses {self._block_size}; "
                "prefix hashes would never match"
            )
        old = self._workers.get(worker_id)
        self._workers[worker_id] = _Worker(dp_size, total_blocks, max_num_batched_tokens, block_size)
        if old is not None and old.dp_size > dp_size:
            for rank in range(dp_size, old.dp_size):
                self._forget_rank((worker_id, rank))
        for rank in range(dp_size):
            self._load.add_worker((worker_id, rank))
            key = (worker_id, rank)
            model = self._timing.get(key)
            fresh = model is None or (model.observations == 0 and self._profiles.get(worker_id) != profile)
            if fresh:
                own = TimingModel(profile or MOCKER_PRIOR, max_num_batched_tokens)
                self._timing[key] = WorkerTiming(own, self._fleet_timing, profile is not None)
            else:
                assert model is not None
                model.own.set_step_budget(max_num_batched_tokens)
            self._fleet_timing.set_step_budget(max_num_batched_tokens)
        self._profiles[worker_id] = profile
        self._keys = [(w, r) for w, info in self._workers.items() for r in range(info.dp_size)]

    def remove_worker(self, worker_id: WorkerId) -> list[ExpiredSession]:
        """Forget a worker: its index state, load and in-flight requests; returns its sessions."""
        info = self._workers.pop(worker_id, None)
        if info is not None:
            for rank in range(info.dp_size):
                self._forget_rank((worker_id, rank))
        self._keys = [(w, r) for w, i in self._workers.items() for r in range(i.dp_size)]
        return [ExpiredSession(sid, w) for sid, w in self._sessions.remove_worker(worker_id)]

    def _forget_rank(self, key: WorkerKey) -> None:
        self._timing.pop(key, None)
        self._decode_s.pop(key, None)
        self._in_system_s.pop(key, None)
        self._index.remove_worker(key)
        self._load.remove_worker(key)
        self._conversations.remove_worker(key)
        self._joins.forget(key)

    @property
    def workers(self) -> list[WorkerKey]:
        return list(self._keys)

    @property
    def block_size(self) -> int | None:
        return self._block_size

    # ---------------------------------------------------------------- KV state
    def apply_events(self, worker_id: WorkerId, batch: EventBatch) -> None:
        """Apply one engine batch (dp rank from ``batch.data_parallel_rank``, None -> 0)."""
        self._index.apply((worker_id, batch.data_parallel_rank or 0), batch.events)

    def load_state(self, worker_id: WorkerId, dp_rank: DpRank, events: Sequence[BlockStored]) -> None:
        """Cold start: replace the rank's index state with these stored events (parents first)."""
        self._index.load_stored((worker_id, dp_rank), events)

    def clear_worker_index(self, worker_id: WorkerId, dp_rank: DpRank | None = None) -> None:
        """Drop index state (subscriber reset: the stream could not be recovered)."""
        info = self._workers.get(worker_id)
        ranks = [dp_rank] if dp_rank is not None else range(info.dp_size if info else 1)
        for rank in ranks:
            self._index.clear_worker((worker_id, rank))

    # ---------------------------------------------------------------- routing
    def route(self, req: RouteRequest, now: float) -> RouteResult:
        """Decide, queue or refuse. A Decision is counted as load immediately."""
        self.last_find_matches = None
        if not self._keys:
            return Rejected(req.request_id, "no_workers", "no workers are registered")
        if req.session_id is not None:
            bound = self._sessions.lookup(req.session_id, now)
            if bound is not None and bound[0] in self._workers:
                if req.session_action == "close":
                    self._sessions.close(req.session_id)
                    self._tell_session(req.session_id, None)
                else:
                    if req.session_timeout is not None:
                        self._sessions.bind(req.session_id, bound, now, req.session_timeout)
                    self._tell_session(req.session_id, bound)
                return self._decide(req, [bound], now, None, "session", filter_busy=False)
            if req.session_action in ("open", "bind"):
                refused = self._session_room(req)
                if refused is not None:
                    return refused
        if req.backend_instance_id is not None:
            info = self._workers.get(req.backend_instance_id)
            if info is None or (req.dp_rank is not None and not 0 <= req.dp_rank < info.dp_size):
                rank = "" if req.dp_rank is None else f" rank {req.dp_rank}"
                return Rejected(
                    req.request_id, "unknown_worker", f"unknown worker {req.backend_instance_id!r}{rank}"
                )
            ranks = [req.dp_rank] if req.dp_rank is not None else list(range(info.dp_size))
            pinned = [(req.backend_instance_id, r) for r in ranks]
            return self._decide(req, pinned, now, None, "pinned", filter_busy=False)
        if self.config.router_mode == "direct":
            return Rejected(req.request_id, "no_target", "router mode 'direct' needs backend_instance_id")
        candidates = self._candidates(req)
        if not candidates:
            return Rejected(req.request_id, "no_workers", "no allowed worker is registered")
        if self.config.router_queue_threshold is not None and (len(self._queue) or self._saturated(now)):
            return self._enqueue(req, now)
        return self._decide(req, candidates, now, None, self._mode_reason())

    def _mode_reason(self) -> DecisionReason:
        mode = self.config.router_mode
        return "kv" if mode in ("kv", "direct") else mode  # type: ignore[return-value]

    def _candidates(self, req: RouteRequest) -> list[WorkerKey]:
        if req.allowed_workers is None:
            return self._keys
        return [k for k in self._keys if k[0] in req.allowed_workers]

    def _prefill_load(self, key: WorkerKey, now: float | None) -> float:
        """Active prefill tokens as the load model sees them (decayed with ``aic``)."""
        if self._aic and now is not None:
            return self._load.prefill_tokens_at(key, now)
        return self._load.prefill_tokens(key)

    def _saturated(self, now: float) -> bool:
        """Every worker has more active prefill tokens than threshold * max_num_batched_tokens."""
        threshold = self.config.router_queue_threshold
        assert threshold is not None
        for key in self._keys:
            if self._prefill_load(key, now) <= threshold * self._workers[key[0]].max_num_batched_tokens:
                return False
        return True

    def _enqueue(self, req: RouteRequest, now: float) -> RouteResult:
        overlaps = self._overlaps(req) if self.config.router_mode == "kv" else None
        best = max((d.device for d in overlaps.values()), default=0) if overlaps else 0
        uncached = max(req.isl_tokens - best * (self._block_size or 1), 0)
        jump = jump_of(req.priority, req.latency_sensitivity)
        key = queue_key(self.config.router_queue_policy, jump, req.arrival, uncached)
        item = Waiting(req.request_id, key, req.arrival, req.isl_tokens, _Pending(req, overlaps, now))
        position = self._queue.push(item)
        if position is None:
            self._stats.queue_rejected += 1
            return Rejected(
                req.request_id,
                "queue_full",
                f"admission queue is full ({self._queue.max_length} requests waiting)",
                self.config.busy_retry_after_secs,
            )
        return Queued(req.request_id, position, len(self._queue))

    def release(self, now: float) -> list[Decision]:
        """Queued requests that may go now (call after feedback frees capacity, or on a timer)."""
        out: list[Decision] = []
        queue = self._queue
        while len(queue) and self._keys and not self._saturated(now):
            item = queue.pop()
            assert item is not None
            pending: _Pending = item.payload
            req = pending.req
            fresh = now - pending.queued_at <= self.config.router_queue_refresh_secs
            candidates = self._candidates(req)
            result = (
                self._decide(req, candidates, now, pending.overlaps if fresh else None, self._mode_reason())
                if candidates
                else None
            )
            if not isinstance(result, Decision):
                queue.push(item)  # every candidate busy (or none left): try again later
                break
            released = Decision(
                result.request_id,
                result.worker,
                result.overlap_blocks,
                result.cached_tokens,
                result.reason,
                result.breakdown,
                now - pending.queued_at,
            )
            recent = self._recent
            if recent and recent[-1][1] is result:  # the history shows the wait as well
                recent[-1] = (recent[-1][0], released)
            out.append(released)
        return out

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
        self._commit(request_id, worker, local_hashes, isl_tokens, overlap_blocks, now, osl, None)

    # ---------------------------------------------------------------- decision
    def _overlaps(self, req: RouteRequest) -> dict[WorkerKey, TierDepths]:
        if self.config.overlap_score_credit == 0 and req.overlap_score_credit in (None, 0):
            return {}
        clock = self._clock
        started = clock() if clock is not None else 0.0
        overlaps = self._index.find_matches_tiered(req.local_hashes)
        if clock is not None:
            self.last_find_matches = (self.last_find_matches or 0.0) + clock() - started
        return overlaps

    def _busy_flags(self, candidates: Sequence[WorkerKey], now: float | None = None) -> list[bool]:
        t = self._busy
        if (
            t.active_decode_blocks_threshold is None
            and t.active_prefill_tokens_threshold is None
            and t.active_prefill_tokens_threshold_frac is None
        ):
            return [False] * len(candidates)
        load = self._load
        out = []
        for key in candidates:
            info = self._workers[key[0]]
            out.append(
                selector.is_busy(
                    load.decode_blocks(key),
                    self._prefill_load(key, now),
                    total_blocks=info.total_blocks,
                    max_num_batched_tokens=info.max_num_batched_tokens,
                    decode_blocks_frac=t.active_decode_blocks_threshold,
                    prefill_tokens_abs=t.active_prefill_tokens_threshold,
                    prefill_tokens_frac=t.active_prefill_tokens_threshold_frac,
                )
            )
        return out

    def _decide(
        self,
        req: RouteRequest,
        candidates: Sequence[WorkerKey],
        now: float,
        overlaps: dict[WorkerKey, TierDepths] | None,
        reason: DecisionReason,
        *,
        filter_busy: bool = True,
    ) -> RouteResult:
        if filter_busy:
            busy = self._busy_flags(candidates, now)
            if all(busy):
                return Rejected(
                    req.request_id,
                    "busy",
                    f"all {len(candidates)} candidate workers are busy",
                    self.config.busy_retry_after_secs,
                )
            if any(busy):
                candidates = [k for k, b in zip(candidates, busy, strict=True) if not b]
        if reason in ("round-robin", "random"):
            if reason == "random":
                chosen = candidates[self._rng.randrange(len(candidates))]
            else:
                chosen = candidates[self._rr % len(candidates)]
                self._rr += 1
            return self._finish(req, chosen, 0, (), now, None)
        if overlaps is None:
            overlaps = self._overlaps(req)
        prompt = (
            PromptBlocks(req.local_hashes)
            if self.config.router_track_active_blocks and self.config.router_assume_kv_reuse
            else None
        )
        bs = self._block_size or 1
        weights = self._weights
        if req.overlap_score_credit is not None or req.prefill_load_scale is not None:
            weights = selector.CostWeights(
                weights.overlap_score_credit
                if req.overlap_score_credit is None
                else req.overlap_score_credit,
                weights.host_cache_hit_weight,
                weights.disk_cache_hit_weight,
                weights.prefill_load_scale if req.prefill_load_scale is None else req.prefill_load_scale,
            )
        load = self._load
        index = self._index
        scores: list[CandidateScore] = []
        costs: list[float] = []
        trees: list[int] = []
        waited = False  # some candidate's cost includes a wait for memory
        own_tokens: list[float] = []
        moved: list[float] = []
        n_blocks = len(req.local_hashes)
        isl = req.isl_tokens
        own_blocks = n_blocks + (1 if isl > n_blocks * bs else 0)  # a partial last block is one more
        latency = self._latency
        conv = self._conversations
        turn = None
        to_come = growth = 0.0
        continues = None  # the tip this turn continues: its growth is the turn's own
        if latency and prompt is not None and prompt.ids:
            turn = conv.lookup(prompt, req.local_hashes, now)
            to_come = conv.turns_to_come(turn.number)
            growth = to_come * conv.growth_blocks
            continues = turn.previous
        cycle_s = conv.cycle_s
        turn_tokens = conv.growth_blocks * bs  # what a later turn adds, to be prefilled
        elsewhere = req.prefilled_elsewhere
        copy_to: set[WorkerKey] | None = None  # the holders: a copy on any other is credited
        copy_ms = 0.0
        if latency and prompt is not None and overlaps and weights.overlap_score_credit > 0 and not elsewhere:
            copy = self._copy_credit(prompt, candidates, overlaps, isl, now)
            if copy is not None:
                copy_to, copy_ms = copy
        # per-decision constants out of the loop, which runs for every candidate
        in_flight_cached = latency and prompt is not None and weights.overlap_score_credit > 0
        scale = weights.prefill_load_scale
        timing_of, workers, reuse, osl = self._timing, self._workers, self._reuse_fleet, req.osl
        joins = self._joins
        for key in candidates:
            depths = overlaps.get(key, _NO_TIERS)
            dev = depths.device
            host = depths.host - dev
            disk = depths.disk - depths.host
            if latency:  # the step running there cannot be joined; what is queued behind it can
                view = load.candidate_view(key, now)
                step_left_s, queued, held, requests_there, generating = view
                active = float(queued)
            else:
                active = load.prefill_tokens_at(key, now) if self._aic else load.prefill_tokens(key)
                held = load.decode_blocks(key)
            if prompt is not None:
                new = load.new_blocks(key, prompt, isl)
            elif self.config.router_track_active_blocks:
                new = own_blocks
            else:
                new = 0
            if in_flight_cached:
                # Blocks of requests in flight there (a sibling sent a moment ago) will be cached
                # by the time this one is prefilled behind them: count them as cached there.
                in_flight = own_blocks - new
                if in_flight > n_blocks:
                    in_flight = n_blocks
                if in_flight > dev:
                    host = max(host - (in_flight - dev), 0)
                    dev = in_flight
            prefill = selector.projected_prefill_tokens(active, isl, dev, host, disk, bs, weights)
            if elsewhere:
                moved.append(prefill - active)
                prefill = active
            decode = held + new
            tree = index.block_count(key)
            if latency:
                # the predicted time to first token there (see _eviction_ms for the whole cost)
                timing = timing_of[key]
                total = max(workers[key[0]].total_blocks, 1)
                wait_ms = 1000.0 * step_left_s
                usage = held / total if held < total else 1.0
                curve = timing.curve()
                ttft = curve.ttft_ms(prefill, generating > 0, usage, wait_ms)
                if wait_ms > 0.0 and joins.joined:  # (a call per candidate only once a join was seen)
                    ttft = self._joining_ttft_ms(key, curve, ttft, wait_ms, prefill - active, now)
                if scale != 1.0:
                    ttft = _weigh_prefill(timing, ttft, prefill, wait_ms, scale)
                memory_ms = 0.0
                if decode > total:  # (it returns 0 below the limit; checked here, as the call is not free)
                    memory_ms = self._memory_wait_ms(key, decode, total, now)
                    waited = waited or memory_ms > 0.0
                    ttft += memory_ms
                added = n_blocks - dev
                # (it returns 0 where the blocks added fit; checked here, as the call is not free)
                evict = (
                    self._eviction_ms(timing, added, total - tree) if reuse and added > total - tree else 0.0
                )
                if growth > 0:
                    evict += self._growth_eviction_ms(key, growth, added, continues)
                returning = overlap = 0.0  # the conversations living there: their turns
                if turn is not None:
                    per_cycle = conv.turns_per_cycle(key, continues)  # a gap between turns' worth of theirs
                    # (it returns 0 unless live conversations there and these blocks overflow the cache)
                    if added > 0 and conv.live_blocks(key) + added > total:
                        evict += self._pushed_out_ms(key, timing, added, total, continues, to_come, per_cycle)
                    if per_cycle > 0.0 and cycle_s > 0.0:
                        returning = per_cycle / cycle_s  # their turns a second (Little's law)
                        if to_come > 0.0 and not turn.sibling:
                            overlap = self._turns_overlap_ms(
                                key, timing, usage, to_come, continues, per_cycle, cycle_s, turn_tokens
                            )
                delay = (
                    self._delay_to_arrivals_ms(
                        key, timing, view, prefill - active, decode, osl, now, returning
                    )
                    if requests_there or returning > 0.0
                    else 0.0  # nothing in flight there and no conversation to come back: no arrivals
                )
                credit = copy_ms if copy_to is not None and key not in copy_to else 0.0
                c = ttft + delay + evict + overlap - credit
                score = CandidateScore(
                    key,
                    dev,
                    host,
                    disk,
                    prefill,
                    prefill / bs,
                    decode,
                    c,
                    False,
                    ttft,
                    evict,
                    wait_ms,
                    credit,
                    delay,
                    overlap,
                    memory_ms,
                )
            else:
                c = selector.cost(prefill, decode, bs, scale)
                score = CandidateScore(key, dev, host, disk, prefill, prefill / bs, decode, c)
            scores.append(score)
            costs.append(c)
            trees.append(tree)
            own_tokens.append(prefill - active)
        if elsewhere and self.config.router_temperature == 0:
            i = self._pick_least_loaded(candidates, moved, costs, trees)
        elif latency and self.config.router_temperature == 0:
            i = self._pick_saving_work(candidates, own_tokens, costs, trees, scores, waited)
        else:
            i = selector.pick(costs, trees, self.config.router_temperature, self._rng)
        if copy_to is not None and candidates[i] not in copy_to:
            self._copies += 1
        return self._finish(req, candidates[i], scores[i].overlap_blocks, tuple(scores), now, prompt, turn, i)

    def _joining_ttft_ms(
        self, key: WorkerKey, curve: Predictor, ttft: float, wait_ms: float, own: float, now: float
    ) -> float:
        """``ttft`` (behind the prefill step in progress on ``key``) with the chance that the
        request gets to the engine before that step starts (:class:`~kvmesh.router.core.joins.Joins`,
        by how soon after the step's request it is routed): then its first token comes with that
        step's, which its tokens make a little longer, and it runs no step of its own."""
        anchor = self._load.anchor(key)
        if anchor is None:
            return ttft
        p = self._joins.share(key, now - anchor[1])
        if p <= 0.0:
            return ttft
        joined = curve.overhead_ms() + wait_ms + curve.added_prefill_ms(float(anchor[2]), own)
        return ttft - p * max(ttft - joined, 0.0)

    def _copy_credit(
        self,
        prompt: PromptBlocks,
        candidates: Sequence[WorkerKey],
        overlaps: dict[WorkerKey, TierDepths],
        isl_tokens: int,
        now: float,
    ) -> tuple[set[WorkerKey], float] | None:
        """``(candidates holding the prompt's deepest cached prefix, what a copy of it on any
        other is worth)``, or None when nothing is worth copying.

        The prefix is the whole chunks of the deepest one cached on a candidate. A candidate holds
        it when it is cached there or a request in flight there carries it (cached by the time this
        one would be prefilled). Its demand is the requests in flight carrying it, over a request's
        stay; the wait one more copy saves them is :func:`copy_saving_ms` over the time the prefix
        has been shared so far. A conversation's own history is carried by no other request in
        flight, so a turn is never credited for leaving it."""
        deepest = max([d.device for d in overlaps.values()])
        found = prompt.chunk_prefix(deepest)
        stay_s = self._decode_fleet
        if found is None or stay_s <= 0.0:
            return None
        identity, depth = found
        load = self._load
        carried = 0
        holders: set[WorkerKey] = set()
        first: WorkerKey | None = None  # in candidate order: a set's order varies by process
        for key in candidates:
            n = load.holding(key, identity)
            carried += n
            if n or overlaps.get(key, _NO_TIERS).device >= depth:
                holders.add(key)
                first = first or key
        if not carried or first is None:
            return None
        age = self._shared.age(identity, now, stay_s)  # every worker may hold it: it still ages
        if len(holders) == len(candidates):
            return None
        suffix = isl_tokens - depth * (self._block_size or 1)
        step_ms = self._timing[first].added_prefill_ms(0.0, suffix)
        return holders, copy_saving_ms(carried / stay_s, step_ms, len(holders), age)

    def _pick_saving_work(
        self,
        candidates: Sequence[WorkerKey],
        own_tokens: Sequence[float],
        costs: Sequence[float],
        trees: Sequence[int],
        scores: Sequence[CandidateScore],
        waited: bool = False,
    ) -> int:
        """The cheapest candidate, except that costs closer than the best one's prediction
        uncertainty are a tie the model cannot resolve: among those, the one where this request
        adds the least prefill work wins (a sibling joins the prefill of the one sent a moment ago,
        rather than recomputing it on an idle worker at about the same predicted time), and the
        capacity saved serves whatever comes next. The uncertainty is the fit's own about its
        expected value, wide on a new worker and narrowing as it learns. (It was the spread of
        single TTFTs, which is mostly where in a step a request lands, the same on every
        candidate: it kept siblings queued behind the first one's step on a learned fleet, where
        another worker holding the context answered ~25 ms sooner.)

        A candidate whose cost includes a wait for memory (``waited``: some candidate's does) is
        uncertain by that wait's spread as well
        (:class:`~kvmesh.router.core.wait_spread.WaitSpread`), and so is the best one: a candidate
        is near when its cost is within the two candidates' uncertainties together (independent
        errors: the root of the sum of squares). (With only the fit's, a conversation's
        last turns, whose home was predicted to wait 1-2 s for memory, went to recompute
        18k-token histories on workers predicted a few hundred ms sooner, and the blocks they took
        there set off moves after them; those home waits came in at 0.4-0.9 of the prediction.)"""
        lowest = min(costs)
        best = costs.index(lowest)
        fit = self._timing[candidates[best]].uncertainty_ms(scores[best].prefill_tokens)
        if waited:
            width = self._wait_spread.width_ms
            base = fit * fit + width(scores[best].memory_wait_ms) ** 2
            near = [
                i
                for i, c in enumerate(costs)
                if c - lowest <= math.sqrt(base + width(scores[i].memory_wait_ms) ** 2)
            ]
        else:
            cutoff = lowest + fit
            near = [i for i, c in enumerate(costs) if c <= cutoff]
        if len(near) == 1:
            return best
        # the least own work, then the lowest cost, then the smallest tree (the selector's
        # tie-break); a random one of those still equal
        keys = [(own_tokens[i], costs[i], trees[i]) for i in near]
        low = min(keys)
        tied = [i for i, k in zip(near, keys, strict=True) if k == low]
        return tied[0] if len(tied) == 1 else self._rng.choice(tied)

    def _pick_least_loaded(
        self,
        candidates: Sequence[WorkerKey],
        moved_tokens: Sequence[float],
        costs: Sequence[float],
        trees: Sequence[int],
    ) -> int:
        """A decode stage: fewest requests in flight, then the least KV to move there, then cost.
        Its cost differs between candidates by little more than the decode passes' growth with KV
        usage, which a model that has not learned the fleet yet cannot tell from noise, so the
        requests the router holds there decide."""
        load = self._load
        keys = [(load.requests(k), moved_tokens[i], costs[i], trees[i]) for i, k in enumerate(candidates)]
        return min(range(len(candidates)), key=keys.__getitem__)

    def _eviction_ms(self, timing: WorkerTiming, added_blocks: int, free_blocks: int) -> float:
        """What placing a request there costs later in evicted cache: the blocks it adds
        (``added_blocks``, those not cached there) beyond the worker's ``free_blocks`` push out
        least-recently-used cache, which the fleet's reported hit share says will be asked for
        again at that rate; recomputing it later costs the fitted per-token prefill time. (The rate
        is the fleet's, not the worker's: a worker's own low hit share would make the worker that
        thrashes most the cheapest place for new prefixes.)

        The rest of a candidate's latency cost is computed in :meth:`_decide`'s loop, which runs for
        every candidate of every decision: the predicted time to first token there, from the
        worker's curve (the prefill work there once this request is added, behind what is left of
        the step running there), plus the wait for KV blocks when the blocks in flight there and
        this request's exceed the worker's (:meth:`_memory_wait_ms`)."""
        evicted = added_blocks - free_blocks
        if evicted <= 0:
            return 0.0
        return self._reuse_fleet * evicted * (self._block_size or 1) * timing.ms_per_token()

    def _growth_eviction_ms(
        self, key: WorkerKey, growth_blocks: float, added_blocks: float, previous: str | None
    ) -> float:
        """What the cache its conversation grows into there evicts from the other conversations
        living there, in their recompute time when they come back.

        A turn's later turns follow it to the worker holding its history, each adding the blocks a
        turn typically adds: ``growth_blocks`` (its turns to come x blocks a turn) more cache
        there. Where the live conversations' blocks (:class:`Conversations`) and this request's
        leave room for that, nothing; beyond it, the excess pushes out blocks that live
        conversations come back for (at the share of turns continued), to be prefilled again at
        the worker's fitted per-token time. Without this the cost saw only the request in hand: a
        new session's first turn, which adds little beyond a cached system prompt, went where that
        prompt was, until a few workers held twelve growing agent sessions each (more than their
        caches), two of eight held none, and turns there waited for memory or recomputed 10k-token
        histories.

        The room is what is left once the conversations already there have grown as well
        (:meth:`Conversations.growth_ahead_blocks`; ``previous``, the tip this turn continues, is
        its own growth): the cache a worker's conversations will need is theirs and this one's
        together, and of that total this conversation's growth is the part beyond what theirs
        leaves. (Counted from their blocks now, a worker whose sessions were all at their first
        turn looked nearly empty to a new session, however far those sessions had yet to grow.)
        """
        conv = self._conversations
        ahead = conv.growth_ahead_blocks(key, previous)
        room = self._workers[key[0]].total_blocks - conv.live_blocks(key) - ahead - added_blocks
        evicted = growth_blocks - max(room, 0.0)
        if evicted <= 0:
            return 0.0
        return conv.continued_share() * evicted * (self._block_size or 1) * self._timing[key].ms_per_token()

    def _pushed_out_ms(
        self,
        key: WorkerKey,
        timing: WorkerTiming,
        added_blocks: int,
        total_blocks: int,
        previous: str | None,
        to_come: float,
        per_cycle: float,
    ) -> float:
        """The live conversations' blocks this request pushes out of ``key``'s cache, prefilled
        again at every turn those conversations bring back while the push lasts.

        The blocks it adds there (``added_blocks``) beyond what the live conversations' blocks
        (:meth:`Conversations.live_blocks`, its own conversation's left out) leave of the cache
        push theirs out. The engine evicts the least recently used first, which is a conversation
        between turns: the next one back finds the pushed blocks gone, prefills them again, and so
        pushes as many out of the next one's history, turn after turn, for as long as this
        request's blocks stay live there (its conversation's ``to_come`` turns and the gap after
        its last). So they cost the worker's fitted per-token time once for every turn the
        conversations there bring back meanwhile: a gap's worth of them (``per_cycle``,
        :meth:`Conversations.turns_per_cycle`) per turn this one has to come and one more, and
        no more than they have left (:meth:`Conversations.turns_ahead`). Conversations at their
        last turns cost little; young ones with most of their turns ahead, a lot.
        (:meth:`_eviction_ms` prices what a request evicts once. With 12 agent sessions on 4
        engines, turns that moved onto an engine whose conversations were between turns pushed
        their histories out, and they were prefilled again at every later turn there.)"""
        conv = self._conversations
        pushed = min(added_blocks, conv.live_blocks(key, previous) + added_blocks - total_blocks)
        if pushed <= 0:
            return 0.0
        returns = min(conv.turns_ahead(key, previous), (1.0 + to_come) * per_cycle)
        if returns <= 0:
            return 0.0
        return returns * pushed * (self._block_size or 1) * timing.ms_per_token()

    def _turns_overlap_ms(
        self,
        key: WorkerKey,
        timing: WorkerTiming,
        usage: float,
        to_come: float,
        previous: str | None,
        per_cycle: float,
        cycle_s: float,
        turn_tokens: float,
    ) -> float:
        """What this conversation's later turns and those of the conversations living on ``key``
        take from each other's time to first token there.

        A turn that finds the worker decoding waits for the rest of the pass in progress, and each
        of its prefill steps carries a decode pass for the others: ``steps + 0.5`` passes against
        the one pass that emits its first token on an idle worker (:meth:`Curve.ttft_ms`), where
        ``steps`` is what a turn's added blocks take. Each conversation has a request in flight
        there for a share ``f`` of the gap between its turns (a request's stay over ``cycle_s``);
        the ``per_cycle`` conversations living there (:meth:`Conversations.turns_per_cycle`) have
        ``f * per_cycle`` in flight at a random moment, so a turn finds the worker decoding with
        the chance ``1 - exp(-f * per_cycle)``. Each of this conversation's ``to_come`` turns meets
        that; each of theirs that comes back while it lives there (no more than they have left,
        :meth:`Conversations.turns_ahead`) finds it in flight as well ``exp(-f * per_cycle) * (1 -
        exp(-f))`` more often. (Without it a new conversation's first turn went where a 208-token
        system prompt was cached: seven of sixteen chats started on one of four engines, and
        their later turns moved away one by one when they met there, recomputing their
        histories; prefix hits 0.80-0.81 against 0.84 for a router that never moves a turn.)"""
        stay_s = self._decode_s.get(key, self._decode_fleet)
        f = stay_s / cycle_s
        if f <= 0.0:
            return 0.0
        if f > 1.0:
            f = 1.0
        idle = math.exp(-f * per_cycle)
        theirs = min(self._conversations.turns_ahead(key, previous), to_come * per_cycle)
        met = to_come * (1.0 - idle) + theirs * idle * (1.0 - math.exp(-f))
        steps = math.ceil(turn_tokens / timing.own.max_batched_tokens) if turn_tokens > 0 else 1
        return met * (steps - 0.5) * timing.decode_ms(usage)

    def _delay_to_arrivals_ms(
        self,
        key: WorkerKey,
        timing: WorkerTiming,
        view: tuple[float, int, float, int, int],
        own_tokens: float,
        blocks_after: float,
        osl: int | None,
        now: float,
        returning_per_s: float = 0.0,
    ) -> float:
        """The time to first token this request takes from the requests that will arrive on ``key``
        while it is there.

        How many arrive: by Little's law, the requests in flight there over the time a request
        stays (``n / W``; ``W`` is the learned time from dispatch to finish there, the queue and the
        wait for memory included), counted from what the router holds now, so a client that waits
        for each answer before sending the next makes no arrivals during it; or, where more, the
        turns the conversations living there send it (``returning_per_s``:
        :meth:`Conversations.turns_per_cycle` over the gap between turns). (``W`` was the time from
        first token to finish alone, which is a request's whole stay only where nothing queues: on
        a worker past its KV cache, whose requests wait up to a second or two for memory before
        their first token, it counted as many times more arrivals than there were as the stay was
        longer than the decode, and the busiest worker looked the worst place for the blocks of a
        turn whose history it held.) Its decode lasts ``osl`` passes when the client
        gave ``agent_hints.osl``, else the learned first-token-to-finish time.
        Its prefill adds ``S`` ms of engine time: the ``rate * S`` requests arriving meanwhile wait
        half of it on average. Its blocks raise the worker's KV usage for its whole decode, which
        lengthens every decode pass there: each request arriving during that time waits for one and
        a half passes longer (the rest of the step in progress and the step emitting its token).
        Beyond the worker's KV blocks, the arrivals wait for memory as well (:meth:`_memory_wait_ms`),
        and the blocks this request adds past the limit are blocks they wait to see freed: each
        waits that share of the cache's turnover time (the worker frees a cache's worth of blocks
        per stay) longer. That lasts while the worker stays over its limit: until the requests
        finishing there have freed the excess and what arrivals bring meanwhile (the blocks in
        flight there over their stay, Little's law again), or for its whole decode when they
        cannot. (Without it the cost saw only the request's own wait for memory, which hinges on
        when the next request there ends: it put turns on a worker already 240 blocks over its
        cache because one request there was about to finish, and the turns behind them waited
        300-500 ms, where spreading the excess over the fleet keeps every wait short.)
        The histories of the conversations living there between turns are cached, not in flight:
        the engine evicts them for the blocks it needs, and no one waits for them. What evicting
        them costs is their recompute when they come back (:meth:`_pushed_out_ms`). (Priced here as
        well, as memory every arrival would wait for, they made every block a request adds to a
        worker under cache pressure a wait for everyone arriving there: conversations moved off
        busy engines, and 48 chats outgrowing four engines' caches had 0.68-0.73 of their prompts
        cached instead of 0.76-0.77.)
        An idle worker charges nothing, so a request that would pile onto a worker already taking
        most of the traffic pays for the queue it makes there; a request that shares blocks already
        in use there (a sibling, a conversation's next turn) adds few blocks and little prefill,
        and pays little.
        """
        _, ahead_tokens, blocks_before, in_flight, _ = view
        stay_s = self._decode_s.get(key, self._decode_fleet)
        if stay_s <= 0.0:
            return 0.0
        # Little's law divides the requests in flight by their whole time there; the decode time
        # alone is the whole only where nothing queues
        in_system_s = self._in_system_s.get(key, self._in_system_fleet)
        if in_system_s < stay_s:
            in_system_s = stay_s
        rate = max(in_flight / in_system_s, returning_per_s)
        if rate <= 0.0:
            return 0.0
        prefill = timing.curve().added_prefill_ms(ahead_tokens, own_tokens)
        total = max(self._workers[key[0]].total_blocks, 1)
        before = min(blocks_before / total, 1.0)
        after = min(blocks_after / total, 1.0)
        own = timing.own  # a decode pass as this worker's streamed gaps have shown it
        pass_after = own.decode_ms(after)
        longer_pass = max(pass_after - own.decode_ms(before), 0.0)
        decode_s = osl * pass_after / 1000.0 if osl is not None and osl > 0 else stay_s
        delay = rate * (prefill / 1000.0) * prefill / 2.0 + rate * decode_s * 1.5 * longer_pass
        added = blocks_after - blocks_before
        over_limit = min(added, blocks_after - total)
        if over_limit > 0:
            inflow = blocks_before / in_system_s
            left_s = self._time_to_free_s(key, blocks_after - total, total, now, stay_s, inflow)
            window = min(left_s, decode_s)
            delay += rate * window * 1000.0 * over_limit / total * stay_s
        return delay

    def _memory_wait_ms(
        self,
        key: WorkerKey,
        decode_blocks: float,
        total_blocks: int,
        now: float,
    ) -> float:
        """How long the request waits for KV blocks on ``key`` when the blocks in flight there
        (``decode_blocks``, its own included) exceed the worker's: until enough requests have
        finished to free the excess, in the order they are expected to finish (their blocks come
        back whole, at the end). (Taking the excess as that share of one request's decode time
        put a 10k-token turn behind six long requests that would all run for another half second
        at 250 ms; it waited 550.) Beyond what every request in flight frees, the rest waits a
        further decode time per cache's worth."""
        excess = decode_blocks - total_blocks
        if excess <= 0:
            return 0.0
        stay_s = self._decode_s.get(key, self._decode_fleet)
        return 1000.0 * self._time_to_free_s(key, excess, total_blocks, now, stay_s, 0.0)

    def _time_to_free_s(
        self,
        key: WorkerKey,
        excess: float,
        total_blocks: int,
        now: float,
        stay_s: float,
        inflow: float,
    ) -> float:
        """Seconds until the requests in flight on ``key`` have freed ``excess`` blocks more than
        arrivals bring meanwhile (``inflow`` blocks a second). Past the last of them: with no
        inflow, a further decode time per ``total_blocks`` still missing; with inflow, never."""
        left = freed = 0.0
        for left, freed in self._load.releases(key, now, stay_s, self._out_tokens):
            if freed - inflow * left >= excess:
                return left
        if inflow > 0:
            return math.inf
        return left + (excess - freed) / total_blocks * stay_s

    def _finish(
        self,
        req: RouteRequest,
        worker: WorkerKey,
        overlap: int,
        breakdown: tuple[CandidateScore, ...],
        now: float,
        prompt: PromptBlocks | None,
        turn: Turn | None = None,
        chosen: int | None = None,
    ) -> Decision:
        """Commit the decision for ``worker`` (``breakdown[chosen]`` when it was scored)."""
        # the queue as this request finds it, before it joins: what it waits for, what it batches with
        view = self._load.step_in_progress(worker, now)
        self._commit(
            req.request_id, worker, req.local_hashes, req.isl_tokens, overlap, now, req.osl, prompt, turn
        )
        if chosen is not None:
            score = breakdown[chosen]
            self._start_observation(
                req, worker, overlap, score.predicted_ttft_ms, now, view, score.memory_wait_ms
            )
        else:
            self._start_observation(req, worker, overlap, None, now, view)
        if self.observer is not None:
            self.observer.routed(req.request_id, worker, req.local_hashes, req.isl_tokens, overlap, req.osl)
        if req.session_id is not None and req.session_action in ("open", "bind"):
            self._sessions.bind(req.session_id, worker, now, req.session_timeout, req.client)
            self._tell_session(req.session_id, worker)
        bs = self._block_size or 1
        decision = Decision(
            req.request_id,
            worker,
            overlap,
            min(overlap * bs, req.isl_tokens),
            self._reason_for(req),
            breakdown,
        )
        self._recent.append((now, decision))
        return decision

    def recent_decisions(self, limit: int = DECISION_HISTORY) -> list[tuple[float, Decision]]:
        """Up to ``limit`` of the last decisions, newest first, each with the time it was made
        (the ``now`` of its ``route()`` or ``release()``): every candidate's cost terms are in its
        ``breakdown``, which is how a placement can be explained after the fact."""
        recent = self._recent
        return [recent[-1 - i] for i in range(min(limit, len(recent)))]

    def _tell_session(self, session_id: str, worker: WorkerKey | None) -> None:
        if self.observer is not None:
            timeout = self._sessions.timeout_of(session_id)
            self.observer.session(
                session_id, worker, self._sessions.default_timeout if timeout is None else timeout
            )

    def apply_session(self, session_id: str, worker: WorkerKey | None, timeout: float, now: float) -> None:
        """A peer replica's session bind, use or close (replica sync): honour its affinity here."""
        if worker is None:
            self._sessions.close(session_id)
        elif self.knows(worker):
            self._sessions.bind(session_id, worker, now, timeout)

    def session_worker(self, session_id: str) -> WorkerKey | None:
        """The worker a live session is bound to (no expiry slide), for tests and the admin view."""
        return self._sessions.peek(session_id)

    def _session_room(self, req: RouteRequest) -> Rejected | None:
        """Refuse a new session past ``--router-max-sessions`` or, for its client, past
        ``--router-max-sessions-per-client`` (each one holds router memory and engine blocks)."""
        sessions = self._sessions
        if req.session_id in sessions:
            return None
        cfg = self.config
        if len(sessions) >= cfg.router_max_sessions:
            return Rejected(
                req.request_id,
                "session_limit",
                f"the router holds its maximum of {cfg.router_max_sessions} sessions",
                1.0,
            )
        if req.client is not None and sessions.owned_by(req.client) >= cfg.router_max_sessions_per_client:
            return Rejected(
                req.request_id,
                "session_limit",
                f"this client holds its maximum of {cfg.router_max_sessions_per_client} sessions; close one first",
            )
        return None

    def _reason_for(self, req: RouteRequest) -> DecisionReason:
        if req.session_id is not None and req.session_id in self._sessions and req.session_action != "open":
            return "session"
        if req.backend_instance_id is not None:
            return "pinned"
        return self._mode_reason()

    def _start_observation(
        self,
        req: RouteRequest,
        worker: WorkerKey,
        overlap: int,
        predicted: float | None,
        now: float,
        view: tuple[float, int],
        memory_wait_ms: float = 0.0,
    ) -> None:
        """``predicted``: the TTFT the decision predicted there (None: the decision made none,
        so it is predicted here), ``memory_wait_ms`` the part of it that is a wait for memory;
        ``view``: the worker's ``step_in_progress`` before this request joined it."""
        model = self._timing.get(worker)
        if model is None:
            return
        load = self._load
        uncached = max(req.isl_tokens - overlap * (self._block_size or 1), 0)
        step_wait_ms, ahead = 1000.0 * view[0], float(view[1])
        # the load after commit: this request's blocks are in
        total = max(self._workers[worker[0]].total_blocks, 1)
        blocks = load.decode_blocks(worker)
        usage = min(blocks / total, 1.0)
        decoding = load.decoding(worker) > 0
        if predicted is None:
            predicted = model.ttft_ms(ahead + uncached, decoding, usage, step_wait_ms)
        obs = self._obs[req.request_id] = _Obs(
            worker,
            now,
            ahead,
            uncached,
            req.isl_tokens,
            decoding,
            usage,
            predicted,
            blocks > total,
            memory_wait_ms,
            step_wait_ms,
        )
        if step_wait_ms > 0.0:
            anchor = load.anchor(worker)  # the step's request (this one joined the queue behind it)
            ahead_obs = self._obs.get(anchor[0]) if anchor is not None else None
            if anchor is not None and ahead_obs is not None and ahead_obs is not obs:
                obs.anchor, obs.gap_s = anchor[0], now - anchor[1]
                if ahead_obs.followers is None:
                    ahead_obs.followers = []
                ahead_obs.followers.append(obs)

    def _commit(
        self,
        request_id: str,
        worker: WorkerKey,
        local_hashes: Sequence[int],
        isl_tokens: int,
        overlap: int,
        now: float,
        osl: int | None,
        prompt: PromptBlocks | None,
        turn: Turn | None = None,
    ) -> None:
        if prompt is None:
            prompt = PromptBlocks(local_hashes) if self._load.assume_kv_reuse else _bare_prompt(local_hashes)
        model = self._timing.get(worker)
        uncached = max(isl_tokens - overlap * (self._block_size or 1), 0)
        expected = model.prefill_ms(uncached) / 1000.0 if model is not None and uncached else 0.0
        self._load.add(
            request_id, worker, prompt, isl_tokens, overlap, now, osl=osl, expected_prefill=expected
        )
        self._index.record(worker, local_hashes, now)
        if self._latency and prompt.ids:
            self._conversations.routed(request_id, worker, prompt, local_hashes, now, turn)

    # ---------------------------------------------------------------- feedback
    def first_token(self, request_id: str, now: float, *, timed: bool = True) -> None:
        """Prefill is done: its prompt tokens stop counting as prefill load. ``timed=False``: the
        caller only learned it at the end (a non-streamed answer), so ``now`` is no TTFT."""
        obs = self._obs.get(request_id)
        if obs is not None and obs.ttft is None:
            obs.ttft = now - obs.dispatched
            obs.last_token = now
            obs.timed = timed
            if obs.followers is not None:  # the requests routed behind its step compare with it
                for follower in obs.followers:
                    if timed:
                        follower.anchor_first_at = now
                    else:  # its answer came whole: no first token to compare with
                        follower.anchor = None
                obs.followers = None
            if timed and obs.anchor is not None:
                self._learn_join(obs, now)
        self._load.prefill_done(request_id, now)
        if self.observer is not None:
            self.observer.prefill_done(request_id)

    def _learn_join(self, obs: _Obs, now: float) -> None:
        """Did a request routed behind a step in progress join it? It did if its first token came
        with the step's request's (within half a step of its own, which it would otherwise have
        needed), or before it (a long prompt's step is chunked: this one joined a chunk)."""
        anchor = obs.anchor
        assert anchor is not None
        at = obs.anchor_first_at
        if at is None:
            if anchor not in self._load:
                return  # the step's request left without a first token: nothing to compare with
            joined = True
        else:
            model = self._timing.get(obs.worker)
            if model is None:
                return
            step_ms = model.curve().step_ms() + model.decode_ms(obs.kv_usage)
            joined = 1000.0 * abs(now - at) < 0.5 * step_ms
        obs.joined = joined
        self._joins.observe(obs.worker, obs.gap_s, joined)

    def output_tokens(self, request_id: str, n: int, now: float) -> None:
        """``n`` more tokens were generated (output-block tracking, liveness, decode timing)."""
        self._load.generated(request_id, n, now)
        obs = self._obs.get(request_id)
        if obs is not None and obs.last_token is not None and n > 0 and obs.timed:
            model = self._timing.get(obs.worker)
            if model is not None:
                total = max(self._workers[obs.worker[0]].total_blocks, 1)
                usage = min(self._load.decode_blocks(obs.worker) / total, 1.0)
                model.observe_itl(1000.0 * (now - obs.last_token) / n, usage)
            obs.last_token = now

    def reported_cached(self, request_id: str, cached_tokens: int) -> None:
        """The engine's ``usage.prompt_tokens_details.cached_tokens`` for one of our requests."""
        obs = self._obs.get(request_id)
        if obs is not None and cached_tokens >= 0:
            obs.cached = cached_tokens

    def finished(self, request_id: str, now: float) -> TimingSample | None:
        """The stream ended: free the request's load (unknown ids are ignored) and teach the
        worker's timing model; returns the prediction made at dispatch beside what happened."""
        generated = self._load.generated_tokens(request_id)
        if generated > 0:
            old_out = self._out_tokens
            self._out_tokens = generated if not old_out else old_out + _REUSE_ALPHA * (generated - old_out)
        if self._load.free(request_id, now) and self.observer is not None:
            self.observer.freed(request_id)
        obs = self._obs.pop(request_id, None)
        if obs is None or obs.ttft is None:
            return None
        model = self._timing.get(obs.worker)
        if model is None:
            return None
        uncached = obs.uncached
        if obs.cached is not None:
            uncached = max(obs.isl - obs.cached, 0)
            if obs.isl > 0:
                hit = min(obs.cached / obs.isl, 1.0)
                if self._seen_reuse:
                    self._reuse_fleet += _REUSE_ALPHA * (hit - self._reuse_fleet)
                else:
                    self._reuse_fleet, self._seen_reuse = hit, True
        if not obs.timed:
            return None
        decode_s = max(now - obs.dispatched - obs.ttft, 0.0)
        self._decode_fleet = _follow(self._decode_s, self._decode_fleet, obs.worker, decode_s)
        in_system_s = max(now - obs.dispatched, 0.0)
        self._in_system_fleet = _follow(self._in_system_s, self._in_system_fleet, obs.worker, in_system_s)
        # A request that joined the step in progress ran no step of its own: its TTFT was that
        # step's, which the step's own request teaches. A request sent where the blocks in flight
        # were past the worker's KV cache waited for memory first: its TTFT is mostly that wait,
        # predicted from when the requests ahead of it would finish, not from the curve, and
        # taking the predicted wait out left that prediction's error in what the curve was fitted
        # to. (On 12-turn agents whose engines were past their caches for most of the run, fits
        # of four identical engines ranged from 0.0001 to 0.043 ms a token against the engine's
        # 0.015, with 35-75% error; fitted only on requests that found their blocks, 0.012-0.019
        # with 8-10%.)
        if obs.past_cache:
            model.waited_for_memory += 1
            if obs.memory_wait_ms > 0.0 and obs.predicted_ms > 0.0:
                # what it waited beyond the rest of its prediction, against the wait predicted
                rest_ms = obs.predicted_ms - obs.memory_wait_ms
                self._wait_spread.observe(obs.memory_wait_ms, 1000.0 * obs.ttft - rest_ms)
        elif not obs.joined:
            model.observe_ttft(
                obs.ahead + uncached, obs.decoding, obs.kv_usage, 1000.0 * obs.ttft, obs.step_wait_ms
            )
        return TimingSample(obs.worker, obs.predicted_ms / 1000.0, obs.ttft)

    def cancel(self, request_id: str, now: float) -> bool:
        """Client gone: drop a queued request or free an in-flight one. True if it was known."""
        if self._queue.cancel(request_id) is not None:
            return True
        freed = self._load.free(request_id, now)
        self._obs.pop(request_id, None)
        if freed and self.observer is not None:
            self.observer.freed(request_id)
        return freed

    def tracking(self, request_id: str) -> bool:
        """True while ``request_id`` counts as load somewhere."""
        return request_id in self._load

    def knows(self, worker: WorkerKey) -> bool:
        """True when ``worker`` (id, dp rank) is registered."""
        info = self._workers.get(worker[0])
        return info is not None and 0 <= worker[1] < info.dp_size

    def expire(self, now: float) -> list[ExpiredSession]:
        """Housekeeping: expire idle sessions (returned, so engine sessions can be closed),
        in-flight requests whose finish never came, and approximate-index blocks past their TTL."""
        gone = self._load.expire(now, self.config.router_request_timeout_secs)
        for rid in gone:
            self._obs.pop(rid, None)
        self._stats.requests_expired += len(gone)
        self._index.expire(now)
        self._conversations.expire(now)
        return [ExpiredSession(sid, w) for sid, w in self._sessions.expire(now)]

    # ---------------------------------------------------------------- runtime knobs / views
    def busy_thresholds(self) -> BusyThresholds:
        return self._busy

    def set_busy_thresholds(
        self,
        *,
        active_decode_blocks_threshold: float | object | None = _UNSET,
        active_prefill_tokens_threshold: int | object | None = _UNSET,
        active_prefill_tokens_threshold_frac: float | object | None = _UNSET,
    ) -> BusyThresholds:
        """Change the busy thresholds at runtime (omitted ones stay; None turns one off)."""
        cur = self._busy
        changes = {
            "active_decode_blocks_threshold": active_decode_blocks_threshold,
            "active_prefill_tokens_threshold": active_prefill_tokens_threshold,
            "active_prefill_tokens_threshold_frac": active_prefill_tokens_threshold_frac,
        }
        merged = {k: (getattr(cur, k) if v is _UNSET else v) for k, v in changes.items()}
        # validate through the config so the messages name the flags and their ranges
        self.config.with_overrides(**merged)
        self._busy = BusyThresholds(**merged)  # type: ignore[arg-type]
        return self._busy

    def engine_load(
        self,
        worker_id: WorkerId,
        running: float,
        waiting: float,
        now: float,
        ranks: Mapping[int, tuple[float, float]] | None = None,
    ) -> None:
        """What ``worker_id``'s engine reports running and waiting (its own gauges, read at each
        health check; 0 and 0 when it reports none): the load there this router did not route
        counts in the latency cost's view of it (:meth:`ActiveSequences.set_unseen`). ``ranks``:
        the same per DP rank, when the engine labels them; each rank then has its own (a rank
        missing there reports none). Without them, or naming a rank the worker does not have, the
        totals are spread evenly over its ranks."""
        info = self._workers.get(worker_id)
        if info is None:
            return
        load = self._load
        if ranks and all(0 <= r < info.dp_size for r in ranks):
            for r in range(info.dp_size):
                run, wait = ranks.get(r, (0.0, 0.0))
                load.set_unseen([(worker_id, r)], run, wait, now)
        else:
            load.set_unseen([(worker_id, r) for r in range(info.dp_size)], running, waiting, now)

    def worker_snapshot(self) -> list[WorkerSnapshot]:
        busy = self._busy_flags(self._keys)
        load = self._load
        out = []
        for key, b in zip(self._keys, busy, strict=True):
            info = self._workers[key[0]]
            out.append(
                WorkerSnapshot(
                    key,
                    load.prefill_tokens(key),
                    load.decode_blocks(key),
                    load.requests(key),
                    self._index.block_count(key),
                    info.total_blocks,
                    info.max_num_batched_tokens,
                    b,
                    self._timing[key].describe() if key in self._timing else None,
                    self._conversations.live_blocks(key),
                    load.unseen_requests(key),
                    self._decode_s.get(key),
                    self._in_system_s.get(key),
                )
            )
        return out

    def conversation_stats(self) -> dict[str, float | int] | None:
        """The conversations the latency cost has learned about (None with Dynamo's cost)."""
        return self._conversations.describe() if self._latency else None

    def join_stats(self) -> dict[str, list[float]] | None:
        """How often requests routed right behind the step in progress on a worker joined it, by
        how soon after its request they were routed (None with Dynamo's cost)."""
        return self._joins.describe() if self._latency else None

    def memory_wait_stats(self) -> dict[str, float] | None:
        """How far the waits for memory came from their predictions: the requests counted and the
        relative spread the choice between close candidates allows for (None with Dynamo's cost)."""
        return self._wait_spread.describe() if self._latency else None

    def shared_prefix_stats(self) -> dict[str, int] | None:
        """Shared prefixes the latency cost follows, and the copies of them it made: requests placed
        on a worker that did not hold the prefix requests in flight shared with them (None with
        Dynamo's cost)."""
        return {"followed": len(self._shared), "copies": self._copies} if self._latency else None

    @property
    def stats(self) -> RouterStats:
        s = self._stats
        c = self._index.counters()
        s.events_applied = c.events_applied
        s.index_pruned_blocks = c.event_pruned_blocks
        s.approx_pruned_blocks = c.approx_pruned_blocks
        return s

    @property
    def queue_pending(self) -> tuple[int, int]:
        """(requests, prompt tokens) waiting in the admission queue."""
        return len(self._queue), self._queue.pending_tokens


def _follow(per_worker: dict[WorkerKey, float], fleet: float, worker: WorkerKey, value: float) -> float:
    """Move ``worker``'s moving average in ``per_worker`` toward ``value`` (its first value taken
    whole) and return the fleet's, moved likewise (taken whole while it is still 0 and the worker
    is new)."""
    old = per_worker.get(worker)
    per_worker[worker] = value if old is None else old + _REUSE_ALPHA * (value - old)
    if old is None and fleet == 0.0:
        return value
    return fleet + _REUSE_ALPHA * (value - fleet)


def _weigh_prefill(
    timing: WorkerTiming, ttft_ms: float, prefill_tokens: float, wait_ms: float, weight: float
) -> float:
    """``--router-prefill-load-scale`` on the latency cost: the prefill part of a predicted TTFT
    (the step waited for and the prefill work) weighed against its decode passes."""
    prefill_part = wait_ms + timing.prefill_ms(prefill_tokens)
    return weight * prefill_part + ttft_ms - prefill_part


def _bare_prompt(local_hashes: Sequence[int]) -> PromptBlocks:
    """A PromptBlocks without identities, for when shared blocks are not deduplicated."""
    p = PromptBlocks.__new__(PromptBlocks)
    p.ids = []
    p.n_anchors = 0
    p.n_blocks = len(local_hashes)
    return p
