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
its predicted time to first token there, computed in :meth:`KvRouter._decide`'s loop over the
candidates, plus the prices :class:`~kvmesh.router.core.latency_cost.LatencyCost` puts on what the
request does to others there (arrivals delayed, live cache evicted, a shared prefix copied). The
model learns from the feedback calls through :class:`~kvmesh.router.core.observations.Observations`:
``first_token`` gives the time from dispatch to first token, ``output_tokens`` the gaps between
tokens, ``reported_cached`` the cached tokens the engine reported; ``finished`` turns them into one
observation and returns a :class:`TimingSample` (prediction at dispatch vs what happened) for
metrics. ``first_token`` also tells whether a request routed behind the step in progress ran in
that step (:class:`~kvmesh.router.core.joins.Joins`): such a request teaches no curve, and the cost
predicts the share of them that do. What requests' stays have shown (:class:`~kvmesh.router.core.stays.Stays`)
is shared by both.

The types of this interface (:class:`RouteRequest`, :class:`Decision`, ...) live in
:mod:`~kvmesh.router.core.route_types` and are importable from here as well.

Two optional hooks, both given by the caller so the core stays pure: a ``clock`` (any
``() -> seconds`` callable) times the prefix lookup of each ``route()`` (``last_find_matches``),
and an ``observer`` (:class:`RoutingObserver`) hears of every decision and every load release,
which is how replica sync shares them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvmesh._types import DpRank, WorkerId, WorkerKey
from kvmesh.errors import WorkerError
from kvmesh.events.wire import BlockStored, EventBatch
from kvmesh.router.core import selector
from kvmesh.router.core.chain_trie import TierDepths
from kvmesh.router.core.config import RouterConfig
from kvmesh.router.core.conversations import Conversations, Turn
from kvmesh.router.core.copies import SharedPrefixes
from kvmesh.router.core.index_factory import index_for
from kvmesh.router.core.joins import Joins
from kvmesh.router.core.latency_cost import NO_TIERS, LatencyCost, weigh_prefill
from kvmesh.router.core.load import ActiveSequences, PromptBlocks
from kvmesh.router.core.observations import Observations
from kvmesh.router.core.pass_lag import PassLag
from kvmesh.router.core.queue import AdmissionQueue, Waiting, jump_of, queue_key
from kvmesh.router.core.route_types import (
    BusyThresholds,
    CandidateScore,
    Decision,
    DecisionReason,
    ExpiredSession,
    PrefixCopy,
    Queued,
    Rejected,
    RejectReason,
    RouteRequest,
    RouteResult,
    RouterStats,
    RoutingObserver,
    SessionAction,
    TimingSample,
    WorkerSnapshot,
)
from kvmesh.router.core.router_state import RouterState, WorkerLimits
from kvmesh.router.core.sessions import SessionTable
from kvmesh.router.core.stays import Stays
from kvmesh.router.core.tail import TtftTail
from kvmesh.router.core.timing import MOCKER_PRIOR, Profile, TimingModel, WorkerTiming
from kvmesh.router.core.wait_spread import WaitSpread

if TYPE_CHECKING:
    import random

__all__ = [
    "DECISION_HISTORY",
    "BusyThresholds",
    "CandidateScore",
    "Decision",
    "DecisionReason",
    "ExpiredSession",
    "KvRouter",
    "Queued",
    "RejectReason",
    "Rejected",
    "RouteRequest",
    "RouteResult",
    "RouterStats",
    "RoutingObserver",
    "SessionAction",
    "TimingSample",
    "WorkerSnapshot",
]
"""The router and the types of its interface (:mod:`~kvmesh.router.core.route_types`), which callers
have always imported from here."""

DECISION_HISTORY = 64
"""Decisions kept for ``GET /kvmesh/decisions``: enough to see a burst's siblings and the turns
around them placed. Each keeps its breakdown, about 0.4 kB per candidate (measured): ~200 kB for
the whole history on 8 workers, ~25 MB on 1,000."""


_UNSET: object = object()


@dataclass(slots=True)
class _Pending:
    """What a queued request needs at release: the request and its arrival-time overlaps."""

    req: RouteRequest
    overlaps: dict[WorkerKey, TierDepths] | None
    queued_at: float


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
        self._workers: dict[WorkerId, WorkerLimits] = {}
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
        self._stays = Stays()
        self._conversations = Conversations()
        self._joins = Joins()
        self._wait_spread = WaitSpread()
        self._shared = SharedPrefixes()
        self._tail = TtftTail()
        self._pass_lag = PassLag()
        state = RouterState(
            self._load,
            self._timing,
            self._workers,
            self._conversations,
            self._joins,
            self._wait_spread,
            self._shared,
            self._stays,
            self._tail,
            self._pass_lag,
        )
        self._cost = LatencyCost(state, rng)
        self._observations = Observations(state)
        self._copies = 0
        """Copies of a shared prefix decided: requests placed on a worker that did not hold the
        prefix requests in flight shared with them, or sent to a holder with a copy to make."""
        self._background_copies = 0
        """Of those, the copies left to the front to make by a prefill of the prefix alone."""
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
            self._load.set_block_size(block_size)
        elif block_size != self._block_size:
            raise WorkerError(
                f"worker {worker_id} uses block size {block_size}, the fleet uses {self._block_size}; "
                "prefix hashes would never match"
            )
        old = self._workers.get(worker_id)
        self._workers[worker_id] = WorkerLimits(dp_size, total_blocks, max_num_batched_tokens, block_size)
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
        self._stays.forget(key)
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

    def flushed(self, worker_id: WorkerId) -> None:
        """The worker's prefix cache was emptied on the router's request: forget what routing
        predicted there (its KV events, when it has them, say the rest)."""
        info = self._workers.get(worker_id)
        for rank in range(info.dp_size if info else 1):
            self._index.forget_predicted((worker_id, rank))

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
        own: bool = False,
    ) -> None:
        """Count a request not routed here (a peer replica's decision, a hop) as load on
        ``worker``. ``own``: a request this router makes itself (a warm-up, a prefix copy), which
        the ``observer`` (replica sync) is told of as it is of a decision, so that peer replicas
        count its load as well."""
        self._commit(request_id, worker, local_hashes, isl_tokens, overlap_blocks, now, osl, None)
        if own and self.observer is not None:
            self.observer.routed(request_id, worker, local_hashes, isl_tokens, overlap_blocks, osl)

    # ---------------------------------------------------------------- decision
    def _overlaps(self, req: RouteRequest) -> dict[WorkerKey, TierDepths]:
        if req.reads_no_cache or (
            self.config.overlap_score_credit == 0 and req.overlap_score_credit in (None, 0)
        ):
            return {}
        clock = self._clock
        started = clock() if clock is not None else 0.0
        index = self._index
        hashes = req.local_hashes
        if req.estimated_blocks > len(hashes) > 0:
            # a later turn known by its earlier turn's blocks: the answer to that turn follows them
            # where it was decoded, and the later prompt goes on with the same tokens
            hashes = [*hashes, *index.continuation(hashes, req.estimated_blocks - len(hashes))]
        overlaps = index.find_matches_tiered(hashes)
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
            (
                PromptBlocks.estimated(
                    req.local_hashes, req.estimated_blocks, hash(req.request_id), self._load.chunk
                )
                if req.estimated_blocks > len(req.local_hashes)
                else PromptBlocks(req.local_hashes, self._load.chunk)
            )
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
        effect_variances: list[float] = []  # (latency cost only)
        moved: list[float] = []
        n_blocks = len(req.local_hashes)
        if n_blocks and prompt is not None:  # a later turn routed on its earlier turn's blocks
            n_blocks = prompt.n_blocks  # (its estimate; a prompt no worker held counts none, as before)
        isl = req.isl_tokens
        own_blocks = n_blocks + (1 if isl > n_blocks * bs else 0)  # a partial last block is one more
        latency = self._latency
        conv = self._conversations
        turn = None
        to_come = to_hold = growth = 0.0
        continues = None  # the tip this turn continues: its growth is the turn's own
        # the worker holding the history this turn continues, its own blocks there and this turn's
        home: WorkerKey | None = None
        home_own = home_new = 0
        # what the home's staying price reads of it (worked out after the loop, where it counts)
        home_outlook: tuple[WorkerTiming, int, int, float] | None = None
        room_elsewhere = False  # another candidate has room for its future and its conversations'
        fleet_need = fleet_total = 0.0  # the candidates' live blocks and growth ahead; their caches
        if latency and prompt is not None and prompt.ids:
            turn = conv.lookup(prompt, req.local_hashes, now)
            to_come = conv.turns_to_come(turn.number)
            to_hold = conv.turns_to_hold(turn.number)  # (the cache's terms: growth, pushed out)
            growth = to_hold * conv.growth_blocks
            continues = turn.previous
            if continues is not None and not turn.sibling:  # (a sibling's history is its twin's)
                held_home = conv.home(continues)
                if held_home is not None:
                    home, home_own, tip_blocks = held_home
                    home_new = max(n_blocks - tip_blocks, 0)
                    # how much of its own history (what no other conversation there shares) the
                    # home's cache kept; a worker whose KV events have told nothing, none yet or
                    # none at all, tells nothing of that
                    if index.block_count(home):
                        at_home = overlaps.get(home)
                        shared = tip_blocks - home_own
                        found = at_home.device - shared if at_home is not None else 0
                        conv.found_at_home(found if found > 0 else 0, home_own)
        # A new conversation's first turn keeps no history anywhere and joins no twin: its ties are
        # the fits' uncertainty alone, not the spread of its effect on others (pick_saving_work)
        effects_widen_ties = turn is None or continues is not None or turn.sibling
        cycle_s = conv.cycle_s
        growth_per_turn = conv.growth_blocks
        turn_tokens = growth_per_turn * bs  # what a later turn adds, to be prefilled
        elsewhere = req.prefilled_elsewhere
        copy_to: set[WorkerKey] | None = None  # the holders: a copy on any other is credited
        copy_ms = 0.0
        copy_blocks = 0
        cost = self._cost
        cost.begin_decision()
        if latency and prompt is not None and overlaps and weights.overlap_score_credit > 0 and not elsewhere:
            copy = cost.copy_credit(prompt, candidates, overlaps, isl, now)
            if copy is not None:
                copy_to, copy_ms, copy_blocks = copy
        # per-decision constants out of the loop, which runs for every candidate
        in_flight_cached = (
            latency and prompt is not None and weights.overlap_score_credit > 0 and not req.reads_no_cache
        )
        scale = weights.prefill_load_scale
        timing_of, workers, reuse, osl = self._timing, self._workers, self._stays.reuse_fleet, req.osl
        joins, pass_lag = self._joins, self._pass_lag
        # the conversations living on each candidate: (live blocks, turns held ahead, turns a gap)
        outlooks = conv.outlooks(candidates, continues) if turn is not None else ()
        for c_i, key in enumerate(candidates):
            depths = overlaps.get(key, NO_TIERS)
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
                # the predicted time to first token there; the other terms are LatencyCost's
                timing = timing_of[key]
                total_blocks = workers[key[0]].total_blocks
                total = max(total_blocks, 1)
                wait_ms = 1000.0 * step_left_s
                usage = held / total if held < total else 1.0
                curve = timing.curve()
                if generating and not wait_ms:  # the rest of the decode pass running there
                    d = curve.decode_ms(usage)
                    rest = pass_lag.rest(load.since_streamed_ms(key, now), d)
                    ttft = curve.ttft_ms(prefill, True, usage, 0.0, rest)
                    start_ms = rest * d
                else:
                    ttft = curve.ttft_ms(prefill, generating > 0, usage, wait_ms)
                    start_ms = wait_ms
                if wait_ms > 0.0 and joins.joined:  # (a call per candidate only once a join was seen)
                    ttft = cost.joining_ttft_ms(key, curve, ttft, wait_ms, prefill - active, now)
                # the weight tilts the cost, not the prediction: the prediction is checked against
                # the TTFT observed (metrics, the fit's error, the tail bound shared by every request)
                weighted = weigh_prefill(timing, ttft, prefill, wait_ms, scale) if scale != 1.0 else ttft
                memory_ms = 0.0
                if decode > total:  # (it returns 0 below the limit; checked here, as the call is not free)
                    memory_ms = cost.memory_wait_ms(key, decode, total, now)
                    waited = waited or memory_ms > 0.0
                    ttft += memory_ms
                    weighted += memory_ms
                added = n_blocks - dev
                # (it returns 0 where the blocks added fit; checked here, as the call is not free)
                evict = (
                    cost.eviction_ms(timing, added, total - tree) if reuse and added > total - tree else 0.0
                )
                returning = overlap = 0.0  # the conversations living there: their turns
                if turn is not None:
                    # per_cycle: a gap between turns' worth of theirs
                    live, held_ahead, per_cycle = outlooks[c_i]
                    ahead_blocks = held_ahead * growth_per_turn
                    # the room their growth and this request's blocks leave its own growth (the
                    # price is 0 where it fits: checked here, as the call is not free)
                    room = total_blocks - live - ahead_blocks - added
                    if growth > 0 and growth > room:
                        evict += cost.growth_eviction_ms(key, growth, room)
                    # (it returns 0 unless live conversations there and these blocks overflow the cache)
                    if added > 0 and live + added > total:
                        held_cycle = conv.held_turns_per_cycle(key, continues)
                        evict += cost.pushed_out_ms(key, timing, added, total, continues, to_hold, held_cycle)
                    if home is not None:
                        fleet_need += live + ahead_blocks
                        fleet_total += total
                        if key == home:  # (its history is counted live there, cached or not)
                            home_outlook = (timing, total, live, held_ahead)
                        elif live + added + ahead_blocks + growth <= total:
                            room_elsewhere = True
                    if per_cycle > 0.0 and cycle_s > 0.0:
                        returning = per_cycle / cycle_s  # their turns a second (Little's law)
                        if to_come > 0.0 and not turn.sibling:
                            overlap = cost.turns_overlap_ms(
                                key, timing, usage, to_come, continues, per_cycle, cycle_s, turn_tokens
                            )
                delay = (
                    cost.delay_to_arrivals_ms(
                        key, timing, view, prefill - active, decode, osl, now, returning
                    )
                    if requests_there or returning > 0.0
                    else 0.0  # nothing in flight there and no conversation to come back: no arrivals
                )
                credit = copy_ms if copy_to is not None and key not in copy_to else 0.0
                c = weighted + delay + evict + overlap - credit
                effect_variances.append(  # how sure the effect on others is (none without one)
                    cost.effect_variance(
                        delay,
                        curve.added_prefill_ms(active, prefill - active) if delay > 0.0 else 0.0,
                        overlap,
                        timing.decode_ms(usage) if overlap > 0.0 else 0.0,
                    )
                    if effects_widen_ties and (delay > 0.0 or overlap > 0.0)
                    else 0.0
                )
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
                    start_ms,
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
        if home_outlook is not None and room_elsewhere and fleet_need + home_new + growth <= fleet_total:
            # Staying costs the conversations living there what leaving would spare them, where
            # another worker has room for its future and the fleet for all of theirs. (Where every
            # worker will overflow, a move only shifts the overflow; priced there as well, the
            # differences between workers' prices outweighed a short history's recompute, and
            # chats under cache pressure left their histories: hits 0.78 to 0.52.)
            assert home is not None
            timing, total, live, held_ahead = home_outlook
            home_held = cost.held_overflow_ms(
                home, timing, total, home_own + home_new, live + home_new, continues, to_hold, held_ahead
            )
            if home_held > 0.0:
                i = candidates.index(home)
                costs[i] += home_held
                scores[i].cost += home_held
                scores[i].eviction_ms += home_held
        if elsewhere and self.config.router_temperature == 0:
            i = self._pick_least_loaded(candidates, moved, costs, trees)
        elif latency and self.config.router_temperature == 0:
            i = cost.pick_saving_work(candidates, own_tokens, costs, trees, scores, effect_variances, waited)
        else:
            i = selector.pick(costs, trees, self.config.router_temperature, self._rng)
        background = None
        if copy_to is not None and candidates[i] not in copy_to:
            self._copies += 1
            if req.copies_in_background and self.config.router_temperature == 0:
                # The copy's credit chose a worker that does not hold the prefix. Where a holder
                # is the choice without that credit, the request goes there and the front copies
                # the prefix alone: its cold prefill then delays no client's first token. (Made by
                # the requests themselves, each copy was a cold prefill among a `hot-prefix` run's
                # slowest requests, whose p99 is a round's third-slowest.)
                uncredited = [c + s.copy_credit_ms for c, s in zip(costs, scores, strict=True)]
                j = cost.pick_saving_work(
                    candidates, own_tokens, uncredited, trees, scores, effect_variances, waited, again=True
                )
                if candidates[j] in copy_to:
                    background = PrefixCopy(candidates[i], copy_blocks)
                    self._background_copies += 1
                    i = j
        return self._finish(
            req, candidates[i], scores[i].overlap_blocks, tuple(scores), now, prompt, turn, i, background
        )

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
        copy: PrefixCopy | None = None,
    ) -> Decision:
        """Commit the decision for ``worker`` (``breakdown[chosen]`` when it was scored), with the
        background copy of its prefix the front is to make (``copy``), if any."""
        # the queue as this request finds it, before it joins: what it waits for, what it batches with
        view = self._load.step_in_progress(worker, now)
        self._commit(
            req.request_id, worker, req.local_hashes, req.isl_tokens, overlap, now, req.osl, prompt, turn
        )
        if chosen is not None:
            score = breakdown[chosen]
            self._observations.start(
                req, worker, overlap, score.predicted_ttft_ms, now, view, score.memory_wait_ms
            )
        else:
            self._observations.start(req, worker, overlap, None, now, view)
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
            copy=copy,
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
            prompt = self._load.prompt_of(local_hashes)
        model = self._timing.get(worker)
        uncached = max(isl_tokens - overlap * (self._block_size or 1), 0)
        expected = model.prefill_ms(uncached) / 1000.0 if model is not None and uncached else 0.0
        self._load.add(
            request_id,
            worker,
            prompt,
            isl_tokens,
            overlap,
            now,
            osl=osl,
            expected_prefill=expected,
            first_block=local_hashes[0] if local_hashes else None,
        )
        self._index.record(worker, local_hashes, now)
        if self._latency and prompt.ids and local_hashes:  # (none yet: amend() brings them)
            self._conversations.routed(request_id, worker, prompt, local_hashes, now, turn)

    def holds_any(self, block_hash: int) -> bool:
        """Some worker holds this block, in any tier, cached or predicted, or a request in flight
        has a prompt that begins with it (cached by the time another would be prefilled)."""
        return self._load.carries_first(block_hash) or bool(self._index.find_matches_tiered((block_hash,)))

    def amend(
        self,
        request_id: str,
        local_hashes: Sequence[int],
        isl_tokens: int,
        now: float,
        osl: int | None = None,
        overlap_score_credit: float | None = None,
        reads_no_cache: bool = False,
    ) -> bool:
        """Count the whole prompt of a request routed while only its first block was known, which
        no worker held (``ParsedRequest.deferred``): its blocks as predicted on its worker, its
        prefill tokens, its conversation. No-op once its first token is in (too late to matter)
        or it is gone. Returns whether it was counted. ``overlap_score_credit``: the request's own
        override (``RouteRequest.overlap_score_credit``), as its decision weighed it;
        ``reads_no_cache``: ``RouteRequest.reads_no_cache``, as its decision took it."""
        load = self._load
        worker = load.worker_of(request_id)
        if worker is None or not load.prefilling(request_id):
            return False
        depth = None if reads_no_cache else self._index.find_matches_tiered(local_hashes).get(worker)
        overlap = depth.device if depth is not None else 0
        prompt = load.prompt_of(local_hashes)
        credit = self._weights.overlap_score_credit if overlap_score_credit is None else overlap_score_credit
        if self._latency and credit > 0 and not reads_no_cache:
            # blocks a request in flight there carries (a sibling sent a moment before, its blocks
            # not yet reported) count as cached, as the decision counted them
            carried = min(load.carried_by_others(request_id, prompt, isl_tokens), len(local_hashes))
            if carried > overlap:
                overlap = carried
        self._commit(request_id, worker, local_hashes, isl_tokens, overlap, now, osl, prompt)
        self._observations.amend(request_id, isl_tokens, overlap)
        return True

    # ---------------------------------------------------------------- feedback
    def first_token(self, request_id: str, now: float, *, timed: bool = True) -> None:
        """Prefill is done: its prompt tokens stop counting as prefill load. ``timed=False``: the
        caller only learned it at the end (a non-streamed answer), so ``now`` is no TTFT."""
        self._observations.first_token(request_id, now, timed)
        self._load.prefill_done(request_id, now)
        if self.observer is not None:
            self.observer.prefill_done(request_id)

    def output_tokens(self, request_id: str, n: int, now: float) -> None:
        """``n`` more tokens were generated (output-block tracking, liveness, decode timing)."""
        self._load.generated(request_id, n, now)
        self._observations.output_tokens(request_id, n, now)

    def reported_cached(self, request_id: str, cached_tokens: int) -> None:
        """The engine's ``usage.prompt_tokens_details.cached_tokens`` for one of our requests."""
        self._observations.reported_cached(request_id, cached_tokens)

    def finished(self, request_id: str, now: float) -> TimingSample | None:
        """The stream ended: free the request's load (unknown ids are ignored) and teach the
        worker's timing model; returns the prediction made at dispatch beside what happened."""
        generated = self._load.generated_tokens(request_id)
        if generated > 0:
            self._stays.generated(generated)
        if self._load.free(request_id, now) and self.observer is not None:
            self.observer.freed(request_id)
        return self._observations.finish(request_id, now)

    def cancel(self, request_id: str, now: float) -> bool:
        """Client gone: drop a queued request or free an in-flight one. True if it was known."""
        if self._queue.cancel(request_id) is not None:
            return True
        freed = self._load.free(request_id, now)
        self._observations.drop(request_id)
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
            self._observations.drop(rid)
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
                    self._stays.decode_s.get(key),
                    self._stays.in_system_s.get(key),
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

    def pass_lag_stats(self) -> dict[str, float | int] | None:
        """How much further into its decode pass an engine is, when a request routed now reaches
        it, than its last tokens say (None with Dynamo's cost)."""
        return self._pass_lag.describe() if self._latency else None

    def memory_wait_stats(self) -> dict[str, float] | None:
        """How far the waits for memory came from their predictions: the requests counted and the
        relative spread the choice between close candidates allows for (None with Dynamo's cost)."""
        return self._wait_spread.describe() if self._latency else None

    def ttft_tail_stats(self) -> dict[str, float | int | None] | None:
        """The times to first token seen and their 99th percentile, beyond which the latency cost
        sends no request another candidate keeps within it (None with Dynamo's cost)."""
        return self._tail.describe() if self._latency else None

    def shared_prefix_stats(self) -> dict[str, int] | None:
        """Shared prefixes the latency cost follows, the copies of them it decided (requests placed
        on a worker that did not hold the prefix requests in flight shared with them, or sent to
        a holder with a copy to make) and how many of those it left to the front to make in the
        background (None with Dynamo's cost)."""
        if not self._latency:
            return None
        return {"followed": len(self._shared), "copies": self._copies, "background": self._background_copies}

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
