"""What the timing models learn from: each routed request followed from dispatch to finish.

At dispatch the router starts an :class:`Observation` with what it predicted and the worker as the
request found it (the prefill queued ahead, the step in progress, KV usage). The feedback calls fill
it in: the first token (time to first token, and whether a request routed right behind a step in
progress joined it: :class:`~kvmesh.router.core.joins.Joins`), the gaps between tokens (each
worker's decode pass), the cached tokens the engine reported. At the finish it teaches the worker's
:class:`~kvmesh.router.core.timing.WorkerTiming`, the learned stays
(:class:`~kvmesh.router.core.stays.Stays`) and, for requests that waited for memory, how far those
waits came from their predictions (:class:`~kvmesh.router.core.wait_spread.WaitSpread`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvmesh._types import WorkerKey
from kvmesh.router.core.route_types import RouteRequest, TimingSample
from kvmesh.router.core.router_state import ReadsState, RouterState
from kvmesh.router.core.timing import HALF_PASS


@dataclass(slots=True)
class Observation:
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
    since_ms: float = math.inf
    """Since the worker last streamed tokens, at dispatch (where in its decode pass it was)."""
    pass_ms: float = 0.0
    """A decode pass there at dispatch, as the worker's gaps between tokens had shown it."""
    rest: float = HALF_PASS
    """The share of that pass the request was predicted to wait for (:mod:`~kvmesh.router.core.pass_lag`)."""
    anchor: str | None = None
    """The request taken to be in that step (None: no step was running)."""
    gap_s: float = 0.0
    """How long after that request became the step in progress this one was routed."""
    anchor_first_at: float | None = None
    """When the anchor showed its first token (None: not yet)."""
    joined: bool = False
    """It showed its first token with the anchor's: it joined that step rather than waiting it out."""
    followers: list[Observation] | None = None
    """The requests routed behind this one's step (told its first token's time)."""
    ttft: float | None = None
    last_token: float | None = None
    cached: int | None = None
    timed: bool = True
    """False when the first token was not seen as such (a non-streamed answer arrives whole): its
    "first token" time is the whole request, which must teach neither TTFT nor decode timing."""


class Observations(ReadsState):
    """The requests in flight being observed, by request id, and what each teaches at its end."""

    def __init__(self, state: RouterState) -> None:
        super().__init__(state)
        self._obs: dict[str, Observation] = {}

    def start(
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
        ``view``: the worker's ``step_in_progress`` before this request joined it. Call it once the
        request counts as load there."""
        model = self._timing.get(worker)
        if model is None:
            return
        self._stays.dispatched(now)
        load = self._load
        uncached = max(req.isl_tokens - overlap * self.block_size, 0)
        step_wait_ms, ahead = 1000.0 * view[0], float(view[1])
        # the load after commit: this request's blocks are in
        total = max(self._workers[worker[0]].total_blocks, 1)
        blocks = load.decode_blocks(worker)
        usage = min(blocks / total, 1.0)
        decoding = load.decoding(worker) > 0
        since_ms, pass_ms, rest = math.inf, 0.0, HALF_PASS
        if decoding and not step_wait_ms:  # the rest of the decode pass running there, as decided
            since_ms, pass_ms = load.since_streamed_ms(worker, now), model.curve().decode_ms(usage)
            rest = self._pass_lag.rest(since_ms, pass_ms)
        if predicted is None:
            predicted = model.ttft_ms(ahead + uncached, decoding, usage, step_wait_ms, rest)
        obs = self._obs[req.request_id] = Observation(
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
            since_ms=since_ms,
            pass_ms=pass_ms,
            rest=rest,
        )
        if step_wait_ms > 0.0:
            anchor = load.anchor(worker)  # the step's request (this one joined the queue behind it)
            ahead_obs = self._obs.get(anchor[0]) if anchor is not None else None
            if anchor is not None and ahead_obs is not None and ahead_obs is not obs:
                obs.anchor, obs.gap_s = anchor[0], now - anchor[1]
                if ahead_obs.followers is None:
                    ahead_obs.followers = []
                ahead_obs.followers.append(obs)

    def first_token(self, request_id: str, now: float, timed: bool) -> None:
        """Its first token came (``timed=False``: the caller only learned it at the end, with a
        non-streamed answer, so ``now`` is no TTFT). Call it before the load hears of it."""
        obs = self._obs.get(request_id)
        if obs is not None and obs.ttft is None:
            obs.ttft = now - obs.dispatched
            obs.last_token = now
            obs.timed = timed
            if timed:
                self._tail.observe(1000.0 * obs.ttft)
            if obs.followers is not None:  # the requests routed behind its step compare with it
                for follower in obs.followers:
                    if timed:
                        follower.anchor_first_at = now
                    else:  # its answer came whole: no first token to compare with
                        follower.anchor = None
                obs.followers = None
            if timed and obs.anchor is not None:
                self._learn_join(obs, now)

    def _learn_join(self, obs: Observation, now: float) -> None:
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
        """``n`` more tokens came: the gap since the last teaches the worker's decode pass. Call it
        once the load has counted them."""
        obs = self._obs.get(request_id)
        if obs is not None and obs.last_token is not None and n > 0 and obs.timed:
            model = self._timing.get(obs.worker)
            if model is not None:
                total = max(self._workers[obs.worker[0]].total_blocks, 1)
                usage = min(self._load.decode_blocks(obs.worker) / total, 1.0)
                model.observe_itl(1000.0 * (now - obs.last_token) / n, usage)
            obs.last_token = now

    def amend(self, request_id: str, isl: int, overlap: int) -> None:
        """Its prompt, routed on an estimate of its length, is known now (``KvRouter.amend``)."""
        obs = self._obs.get(request_id)
        if obs is not None:
            obs.isl = isl
            obs.uncached = max(isl - overlap * self.block_size, 0)

    def reported_cached(self, request_id: str, cached_tokens: int) -> None:
        """The engine's ``usage.prompt_tokens_details.cached_tokens`` for one of our requests."""
        obs = self._obs.get(request_id)
        if obs is not None and cached_tokens >= 0:
            obs.cached = cached_tokens

    def drop(self, request_id: str) -> None:
        """Forget a request that teaches nothing (cancelled, or expired without a finish)."""
        self._obs.pop(request_id, None)

    def finish(self, request_id: str, now: float) -> TimingSample | None:
        """The request ended (its load already freed): teach what it showed; returns the prediction
        made at dispatch beside what happened (None: it showed no first token, or none timed)."""
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
                self._stays.hit(min(obs.cached / obs.isl, 1.0))
        if not obs.timed:
            return None
        decode_s = max(now - obs.dispatched - obs.ttft, 0.0)
        self._stays.finished(obs.worker, decode_s, max(now - obs.dispatched, 0.0))
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
            x_tokens = obs.ahead + uncached
            if obs.pass_ms > 0.0:  # what the curve leaves unexplained, the pass aside, teaches the lag
                bare = model.ttft_ms(x_tokens, True, obs.kv_usage, 0.0, 0.0)
                self._pass_lag.observe(obs.since_ms, obs.pass_ms, 1000.0 * obs.ttft - bare)
            model.observe_ttft(
                x_tokens, obs.decoding, obs.kv_usage, 1000.0 * obs.ttft, obs.step_wait_ms, obs.rest
            )
        return TimingSample(obs.worker, obs.predicted_ms / 1000.0, obs.ttft)
