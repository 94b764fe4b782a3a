"""A worker's timing model: predicted time to first token, fitted online from what the router sees.

Why: Dynamo's cost adds prefill blocks and decode blocks 1:1, but one uncached prefill block costs
far more engine time than one block held in decode, and the right exchange rate depends on the
model, the hardware and the traffic. Predicting time directly needs no exchange rate.

The model (milliseconds). A request that finds ``X`` tokens of prefill work waiting on a worker (the
uncached prompt tokens of requests queued there for the next step, plus its own) is prefilled in
``k = ceil(X / B)`` engine steps of at most ``B`` tokens (``max_num_batched_tokens``)::

    prefill(X) = a * sum(chunk_tokens^2) + b * X + c * k        (the curve engines are fitted with)
    ttft(X)    = o + w + r + prefill(X) + n_decode * d(p)

``w`` is what is left of a prefill step already running there (the caller's estimate, from the
predicted prefill time of the oldest request in prefill and when it started): engines admit work at
step boundaries, so a request cannot join that step and waits for it whole. Without it, a request
arriving just after another one's long prefill had started was predicted to share its step, and a
worker busy with a 1.6k-token prefill cost the same as an idle one. (A request routed right
after the one in that step can reach the engine before the step starts and run in it: the router
learns how often (:mod:`kvmesh.router.core.joins`), predicts it, and does not fit the curve to the
TTFTs of requests that did, which had no prefill of their own.)

``o`` is the worker's fixed overhead per request: everything between the router's dispatch and the
first token that is not engine work (HTTP, the engine's own request handling, the streaming of the
first event back). It is not engine time, so nothing queued behind the request waits for it:
:meth:`TimingModel.prefill_ms` (what the request adds to a worker's queue) leaves it out. Without
this term the fit had to explain the overhead with the per-token slope and, on short prompts,
learned slopes 10x the engine's. ``o`` and ``c`` are told apart by prompts that take more than one
step (``k > 1``); until such prompts come, their sum is what the data fixes and the prior splits it.

Every step that also advances requests already generating runs a decode pass of ``d(p)`` ms (``p``
the share of KV blocks in use): ``n_decode = k`` when some request decodes there, else 1 (the step
that emits this request's first token). On a worker that is decoding, a request also arrives in the
middle of a step and starts at the next one, since engines admit work only at step boundaries:
``r = rest * d(p)``, the share of the pass in progress still to run when it gets there, which the
caller reads off when that worker last streamed tokens (:mod:`~kvmesh.router.core.pass_lag`), and
half a pass, the average, where it cannot tell (0 on a worker that is not decoding). Without the
term, joining a busy worker looked as cheap as an idle one (only ``d(p)`` grows, ~1.6 ms per
conversation's blocks) and a 184-token shared system prompt was enough to pile a whole chat fleet
onto one engine. With the average alone, the fit saw the spread of that wait, up to a whole pass,
as noise, and a request went to whichever worker held the smallest tree where another was a few
milliseconds from ending its pass. Behind a
running prefill step (``w > 0``) the rest of that step is a whole pass (it ends with the pass that
emits its request's first token), and every step after it has one (that request decodes by then):
``r = d(p)``, ``n_decode = k``. ``d(p)`` is the prior's decode curve scaled by a factor learned
from the gaps between streamed tokens.

Fitting: Bayesian recursive least squares (a Kalman filter for constant coefficients) on
``(a, b, c, o)``. The prior is the seed curve with a standard deviation of ``PRIOR_SPREAD`` times each
coefficient (the overhead's: as much of a step constant ``c``), and each observation is weighed by the noise
variance the model measures (a robust scale of its residuals). That weighing is what keeps the fit
sane: a request's TTFT also holds the unmodelled remainder of the step in progress when it
arrived, tens of ms, while short prompts change ``b * X`` by a few ms. An observation that cannot
tell the slope apart from that noise barely moves it; long prompts, whose prefill dominates, do.
(The first version treated every residual as exact to 1 ms and followed the last few requests:
slopes swung from 0 to 20x the engine's within one run.) A forgetting factor lets a worker that
slows down be followed within a few dozen requests; the covariance never grows past the prior's (the
data can only make the model surer than its seed), and residuals beyond ``CLIP`` scales count only
as ``CLIP`` scales, so one stalled request cannot drag the curve. Coefficients stay non-negative.
The seed is a worker's reported profile (``/kvmesh/info`` ``timing_profile``) or the reference
mocker's fit; both are only a starting point. The router does not feed it requests it sent where
the blocks in flight were past the worker's KV cache: their TTFTs are mostly a wait for memory,
which the router predicts apart, from when the requests ahead free their blocks.

A worker the router has barely seen borrows from the fleet: :class:`WorkerTiming` predicts with
a blend of the worker's own fit and a fleet-wide one, weighted by how many observations the
worker has (``n / (n + SHRINK)``). Without that, a worker that already answered a few requests
quickly would look faster than an identical one still on the (slower) prior, and take the traffic
for the wrong reason. A worker that reported its own profile starts from that instead.

Pure: no clock, no I/O. Callers pass the features and the observed times.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

KTOK = 1000.0
"""Features are in thousands of tokens, so the coefficients have similar magnitudes."""
FORGET = 0.98
"""RLS forgetting factor: observations older than ~1 / (1 - FORGET) requests fade out."""
CLIP = 3.0
"""Residuals beyond this many robust scales are clipped (Huber-style)."""
SCALE_ALPHA = 0.05
"""EWMA weight of the robust residual scale, the decode scale and the error statistics."""
MAD_TO_SD = math.sqrt(math.pi / 2)
"""Mean absolute deviation to standard deviation, for normal noise: the noise variance the fit
weighs observations with is ``(MAD_TO_SD * scale_ms) ** 2``."""
PRIOR_SPREAD = 1.0
"""Prior standard deviation of each coefficient, in multiples of its seed value: the seed is taken
to be right to within its own size. A router sees tens of requests per worker, each with tens of
ms of queueing the model does not explain; a wider prior let a handful of them throw the
coefficients around (measured: per-token slopes from 0 to 6x the engine's within one short run).
A worker further off than that is found by the change detection (``CHANGE_RUN``), which returns
the fit to this uncertainty as often as the residuals keep saying the curve is wrong."""
CHANGE_RUN = 3
"""Clipped residuals in a row, on one side, taken as a change of the worker rather than outliers.
Beyond ``CLIP`` scales a residual has well under a 1% chance under the measured noise, so three in
a row on one side (< 1e-6) do not happen to a worker that stayed the same."""
SHRINK = 20.0
"""Observations after which a worker's own fit and the fleet's weigh the same."""
HALF_PASS = 0.5
"""The share of a decode pass in progress a request waits for, on average."""
N = 4
"""Coefficients: (a, b, c, o), see the module docstring."""


@dataclass(frozen=True, slots=True)
class Profile:
    """A step-time curve: prefill ``c2*T^2 + c1*T + c0`` ms (T tokens in a step), decode
    ``max(decode_min, d2*p^2 + d1*p + d0)`` ms (p = KV usage share)."""

    prefill_ms: tuple[float, float, float]
    decode_ms: tuple[float, float, float]
    decode_min_ms: float
    source: str

    def decode(self, p: float) -> float:
        # comparisons rather than min()/max() calls: this runs for every candidate of every decision
        p = 0.0 if p < 0.0 else (1.0 if p > 1.0 else p)
        d2, d1, d0 = self.decode_ms
        ms = d2 * p * p + d1 * p + d0
        return ms if ms > self.decode_min_ms else self.decode_min_ms

    @classmethod
    def from_info(cls, doc: Any) -> Profile | None:
        """The ``timing_profile`` object of a worker's ``/kvmesh/info``; None when absent or malformed."""
        if not isinstance(doc, Mapping):
            return None
        try:
            prefill = _triple(doc["prefill_ms"])
            decode = _triple(doc["decode_ms"])
            floor = float(doc.get("decode_min_ms", 0.0))
        except (KeyError, TypeError, ValueError):
            return None
        if prefill[0] < 0 or prefill[1] < 0 or prefill[2] < 0 or not math.isfinite(floor):
            return None
        return cls(prefill, decode, max(floor, 0.0), "worker profile")


def _triple(x: Any) -> tuple[float, float, float]:
    if not isinstance(x, Sequence) or len(x) != 3:
        raise ValueError("need three coefficients")
    a, b, c = (float(v) for v in x)
    if not all(math.isfinite(v) for v in (a, b, c)):
        raise ValueError("coefficients must be finite")
    return a, b, c


MOCKER_PRIOR = Profile(
    (4.209989e-07, 1.518344e-02, 16.50142), (-25.74, 54.01, 5.74), 1.0, "reference mocker fit"
)
"""NVIDIA Dynamo's mocker fit to a real vLLM deployment: the prior for a worker with no profile."""


_last_features: tuple[float, int, tuple[float, float, float]] = (0.0, 1, (0.0, 0.0, 1.0))
"""The features :func:`features` worked out last, with their arguments: a decision asks for the same
ones over and over (every candidate that holds none of the prompt has the same prefill to do: 11 of
a 2,048-block decision's 13 calls on eight such workers)."""


def features(x_tokens: float, budget: int) -> tuple[float, float, float]:
    """``(sum of squared chunk sizes, tokens, steps)`` of ``x_tokens`` split into ``budget`` chunks,
    in thousands of tokens."""
    global _last_features
    last = _last_features
    if last[0] == x_tokens and last[1] == budget:
        return last[2]
    if x_tokens <= 0:
        return 0.0, 0.0, 1.0
    if budget < 1:
        budget = 1
    full, rest = divmod(x_tokens, budget)
    steps = full + (1 if rest > 0 else 0)
    bk = budget / KTOK
    rk = rest / KTOK
    out = (full * bk * bk + rk * rk, x_tokens / KTOK, float(steps))
    _last_features = (x_tokens, budget, out)
    return out


class Curve:
    """A TTFT curve's predictions from its coefficients ``theta`` (a, b, c, o), the prior's decode
    curve times ``decode_scale`` and the step budget (see the module docstring)."""

    __slots__ = ("decode_scale", "max_batched_tokens", "prior", "theta")

    def __init__(
        self, prior: Profile, max_batched_tokens: int, theta: list[float], decode_scale: float
    ) -> None:
        self.prior = prior
        self.max_batched_tokens = max(int(max_batched_tokens), 1)
        self.theta = theta
        self.decode_scale = decode_scale

    # ------------------------------------------------------------------ prediction
    def prefill_ms(self, x_tokens: float) -> float:
        """Modelled engine time to prefill ``x_tokens`` (chunked at the step budget), overhead
        excluded: the time the worker is busy with it."""
        s2, s1, k = features(x_tokens, self.max_batched_tokens)
        a, b, c, _ = self.theta
        return a * s2 + b * s1 + c * k

    def added_prefill_ms(self, ahead_tokens: float, own_tokens: float) -> float:
        """Engine time ``own_tokens`` add to a worker with ``ahead_tokens`` of prefill queued: the
        marginal cost, so the step constant counts only for the steps the request adds (a request
        that joins a step already due pays its tokens, not the step)."""
        if own_tokens <= 0:
            return 0.0
        if ahead_tokens <= 0:  # no step is due: it adds one
            return self.prefill_ms(own_tokens)
        return max(self.prefill_ms(ahead_tokens + own_tokens) - self.prefill_ms(ahead_tokens), 0.0)

    def decode_ms(self, kv_usage: float) -> float:
        return self.decode_scale * self.prior.decode(kv_usage)

    def overhead_ms(self) -> float:
        return self.theta[3]

    def step_ms(self) -> float:
        """The fitted constant of a prefill step: what a step costs beyond its tokens."""
        return self.theta[2]

    def ttft_ms(
        self, x_tokens: float, decoding: bool, kv_usage: float, wait_ms: float = 0.0, rest: float = HALF_PASS
    ) -> float:
        """Predicted ms to first token with ``x_tokens`` of prefill work queued, its own included,
        behind ``wait_ms`` left of a prefill step already running; ``rest`` the share of the decode
        pass in progress it waits for on a worker that is decoding (half on average;
        :mod:`~kvmesh.router.core.pass_lag` reads it off the worker's last tokens)."""
        s2, s1, k = features(x_tokens, self.max_batched_tokens)
        a, b, c, o = self.theta
        # _decode_passes_ms, inlined: this runs for every candidate of every decision
        d = self.decode_scale * self.prior.decode(kv_usage)
        if wait_ms > 0:
            passes = (k + 1.0) * d
        elif decoding:
            passes = (k + rest) * d
        else:
            passes = d
        return o + wait_ms + a * s2 + b * s1 + c * k + passes

    def _decode_passes_ms(
        self, steps: float, decoding: bool, kv_usage: float, wait_ms: float = 0.0, rest: float = HALF_PASS
    ) -> float:
        """The decode passes before the first token: the rest of the step in progress (``rest`` of a
        pass) and one per prefill step on a worker that is decoding; else the one pass that
        emits the first token. Behind a running prefill step, that step's own pass (it emits its
        request's first token) and one per step after it: the request that ran it decodes by then."""
        d = self.decode_ms(kv_usage)
        if wait_ms > 0:  # the running step ends with the pass that emits its first token
            return (steps + 1.0) * d
        if not decoding:
            return d
        return (steps + rest) * d

    def ms_per_token(self) -> float:
        """What recomputing an evicted token costs, in ms: a full step's prefill time over its
        tokens, the step's constant aside (``a * budget + b``). Recomputed blocks ride in the
        prefill steps of the turn that comes back for them. Not the linear coefficient alone: over
        the prompt lengths a fleet sends, the fit can trade its quadratic coefficient against its
        linear one with little change to any prediction, and on four identical engines the linear
        coefficient read 0.008-0.017 ms a token against the engine's 0.015, so every price of
        eviction differed by 2x between them. A full step's time is what the observations pin
        down (0.018-0.020 there; the engine's is 0.0186)."""
        a, b = self.theta[0], self.theta[1]
        return (a * (self.max_batched_tokens / KTOK) + b) / KTOK


class TimingModel(Curve):
    """One worker's fitted TTFT model (see the module docstring). Not thread-safe."""

    __slots__ = (
        "_p",
        "_p0",
        "_run",
        "abs_error_ms",
        "changes",
        "observations",
        "outliers",
        "rel_error",
        "scale_ms",
        "version",
    )

    def __init__(self, prior: Profile, max_batched_tokens: int) -> None:
        c2, c1, c0 = prior.prefill_ms
        step = max(c0, 1.0)
        super().__init__(prior, max_batched_tokens, [c2 * KTOK * KTOK, c1 * KTOK, c0, 0.0], 1.0)
        # prior: each coefficient may be PRIOR_SPREAD times off its seed (at least 1 in feature
        # units); the overhead, unknown, as much as a step constant
        sd = [PRIOR_SPREAD * max(v, 1.0) for v in self.theta[:3]] + [PRIOR_SPREAD * step]
        self._p0 = [sd[i] ** 2 for i in range(N)]
        self._p = [[self._p0[i] if i == j else 0.0 for j in range(N)] for i in range(N)]
        self.scale_ms = step
        self._run = 0
        """Consecutive clipped residuals, signed by their side."""
        self.changes = 0
        self.observations = 0
        self.outliers = 0
        self.abs_error_ms = 0.0
        self.rel_error = 0.0
        self.version = 0
        """Bumped whenever a prediction could change (coefficients, decode scale, step budget)."""

    def set_step_budget(self, max_batched_tokens: int) -> None:
        self.max_batched_tokens = max(int(max_batched_tokens), 1)
        self.version += 1

    # ------------------------------------------------------------------ uncertainty
    def uncertainty_ms(self, x_tokens: float) -> float:
        """Standard deviation of the predicted TTFT's expected value at ``x_tokens`` (``sqrt(phi' P
        phi)``, the fit's own uncertainty about its coefficients): wide on the prior, narrowing as
        the worker is learned. Not the spread of single TTFTs around it (``scale_ms``): that comes
        from where in a step a request happens to land, which no choice of worker changes."""
        s2, s1, k = features(x_tokens, self.max_batched_tokens)
        p0, p1, p2, p3 = self._p  # N == 4, unrolled: this runs for every routing decision
        var = (
            s2 * (p0[0] * s2 + p0[1] * s1 + p0[2] * k + p0[3])
            + s1 * (p1[0] * s2 + p1[1] * s1 + p1[2] * k + p1[3])
            + k * (p2[0] * s2 + p2[1] * s1 + p2[2] * k + p2[3])
            + (p3[0] * s2 + p3[1] * s1 + p3[2] * k + p3[3])
        )
        return math.sqrt(max(var, 0.0))

    def noise_ms(self) -> float:
        """The spread (one standard deviation) of single TTFTs around the prediction: where in a
        step a request happens to land, which the fit cannot explain (the noise it weighs
        observations with)."""
        return MAD_TO_SD * self.scale_ms

    # ------------------------------------------------------------------ learning
    def observe_ttft(
        self,
        x_tokens: float,
        decoding: bool,
        kv_usage: float,
        ttft_ms: float,
        wait_ms: float = 0.0,
        rest: float = HALF_PASS,
    ) -> float:
        """Learn from one request; returns the prediction it made (before the update)."""
        predicted = self.ttft_ms(x_tokens, decoding, kv_usage, wait_ms, rest)
        if not (ttft_ms > 0 and math.isfinite(ttft_ms)):
            return predicted
        s2, s1, k = features(x_tokens, self.max_batched_tokens)
        phi = (s2, s1, k, 1.0)
        y = ttft_ms - wait_ms - self._decode_passes_ms(k, decoding, kv_usage, wait_ms, rest)
        residual = y - sum(p * t for p, t in zip(phi, self.theta, strict=True))
        limit = CLIP * self.scale_ms
        if abs(residual) > limit:
            # One far residual is an outlier (a stalled request); a run of them on one side is
            # the worker having changed: forget back to the prior's uncertainty and learn it.
            side = 1 if residual > 0 else -1
            self._run = self._run + side if self._run * side > 0 else side
            if abs(self._run) >= CHANGE_RUN:
                self._reset_uncertainty()
            else:
                self.outliers += 1
                residual = side * limit
        else:
            self._run = 0
        noise = self.noise_ms() ** 2
        self.scale_ms += SCALE_ALPHA * (min(abs(residual), limit) - self.scale_ms)
        self.scale_ms = max(self.scale_ms, 0.5)
        self._rls(phi, residual, noise)
        self.observations += 1
        self.version += 1
        err = abs(predicted - ttft_ms)
        self.abs_error_ms += SCALE_ALPHA * (err - self.abs_error_ms)
        self.rel_error += SCALE_ALPHA * (err / ttft_ms - self.rel_error)
        return predicted

    def observe_itl(self, gap_ms: float, kv_usage: float) -> None:
        """One gap between streamed tokens: the decode pass's length, prior curve times a scale."""
        base = self.prior.decode(kv_usage)
        if not (gap_ms > 0 and base > 0 and math.isfinite(gap_ms)):
            return
        sample = min(gap_ms / base, CLIP * max(self.decode_scale, 0.1) + 1.0)
        self.decode_scale += SCALE_ALPHA * (sample - self.decode_scale)
        self.version += 1

    def _rls(self, phi: tuple[float, ...], residual: float, noise: float) -> None:
        """One Kalman step: ``gain = P phi / (noise + phi' P phi)``, then forgetting (``P / FORGET``)
        bounded by the prior's variances."""
        p = self._p
        p_phi = [sum(p[i][j] * phi[j] for j in range(N)) for i in range(N)]
        denom = noise + sum(phi[i] * p_phi[i] for i in range(N))
        gain = [v / denom for v in p_phi]
        theta = self.theta
        for i in range(N):
            theta[i] = max(0.0, theta[i] + gain[i] * residual)
        for i in range(N):
            row = p[i]
            gi = gain[i]
            for j in range(N):
                row[j] = (row[j] - gi * p_phi[j]) / FORGET
        # never less sure than the prior: scale the covariance back where a variance outgrew it
        worst = max(p[i][i] / self._p0[i] for i in range(N))
        if worst > 1.0:
            for row in p:
                for j in range(N):
                    row[j] /= worst

    def _reset_uncertainty(self) -> None:
        self.changes += 1
        self._run = 0
        self._p = [[self._p0[i] if i == j else 0.0 for j in range(N)] for i in range(N)]

    def describe(self) -> dict[str, Any]:
        """The fitted coefficients in the prior's units, and how well they predict."""
        a, b, c, o = self.theta
        return {
            "seed": self.prior.source,
            "prefill_ms": [a / (KTOK * KTOK), b / KTOK, c],
            "overhead_ms": round(o, 3),
            "decode_scale": round(self.decode_scale, 4),
            "observations": self.observations,
            "outliers_clipped": self.outliers,
            "changes_detected": self.changes,
            "noise_ms": round(self.noise_ms(), 3),
            "ttft_abs_error_ms": round(self.abs_error_ms, 3),
            "ttft_rel_error": round(self.rel_error, 4),
        }


class _Weighed:
    """Two fits that cannot be one curve (they chunk prompts at different step budgets, or decode
    on different prior curves): each predicts, and the predictions are weighed."""

    __slots__ = ("fleet", "own", "w")

    def __init__(self, own: TimingModel, fleet: TimingModel, w: float) -> None:
        self.own, self.fleet, self.w = own, fleet, w

    def ttft_ms(
        self, x_tokens: float, decoding: bool, kv_usage: float, wait_ms: float = 0.0, rest: float = HALF_PASS
    ) -> float:
        own = self.own.ttft_ms(x_tokens, decoding, kv_usage, wait_ms, rest)
        fleet = self.fleet.ttft_ms(x_tokens, decoding, kv_usage, wait_ms, rest)
        return self.w * own + (1.0 - self.w) * fleet

    def prefill_ms(self, x_tokens: float) -> float:
        return self.w * self.own.prefill_ms(x_tokens) + (1.0 - self.w) * self.fleet.prefill_ms(x_tokens)

    def added_prefill_ms(self, ahead_tokens: float, own_tokens: float) -> float:
        own = self.own.added_prefill_ms(ahead_tokens, own_tokens)
        return self.w * own + (1.0 - self.w) * self.fleet.added_prefill_ms(ahead_tokens, own_tokens)

    def overhead_ms(self) -> float:
        return self.w * self.own.overhead_ms() + (1.0 - self.w) * self.fleet.overhead_ms()

    def decode_ms(self, kv_usage: float) -> float:
        return self.w * self.own.decode_ms(kv_usage) + (1.0 - self.w) * self.fleet.decode_ms(kv_usage)

    def step_ms(self) -> float:
        return self.w * self.own.step_ms() + (1.0 - self.w) * self.fleet.step_ms()


Predictor = Curve | _Weighed
"""What predicts for a worker (:meth:`WorkerTiming.curve`)."""


class WorkerTiming:
    """A worker's timing model, shrunk toward the fleet's while it has few observations.

    Predictions are linear in the coefficients, so the blend of the two fits is one curve with
    blended coefficients (:meth:`curve`): it is built once per change of either fit (the fleet's
    changes with every finished request, a worker's with its own) and predicts at the cost of one
    model. The blended marginal prefill is the blend of the fits' marginal prefills too: the
    coefficients are non-negative, so each fit's marginal cost is."""

    __slots__ = ("_mix", "_mix_fleet", "_mix_own", "fleet", "own", "profiled", "waited_for_memory")

    def __init__(self, own: TimingModel, fleet: TimingModel, profiled: bool) -> None:
        self.own = own
        self.fleet = fleet
        self.profiled = profiled
        self.waited_for_memory = 0
        """Requests sent here past the worker's KV cache, whose TTFTs were not fitted (counted by
        ``KvRouter.finished``)."""
        self._mix: Curve | _Weighed | None = None
        self._mix_own = self._mix_fleet = -1
        """The fits' versions the blend was built from."""

    def _weight(self) -> float:
        if self.profiled:
            return 1.0
        n = self.own.observations
        return n / (n + SHRINK)

    def curve(self) -> Predictor:
        """What predicts for this worker (``ttft_ms``, ``prefill_ms``, ``added_prefill_ms``): its
        own fit when it is profiled, else the blend. The router takes it once per candidate."""
        if self.profiled:
            return self.own
        own, fleet = self.own, self.fleet
        mix = self._mix
        if mix is not None and self._mix_own == own.version and self._mix_fleet == fleet.version:
            return mix
        self._mix_own, self._mix_fleet = own.version, fleet.version
        w = self._weight()
        if own.max_batched_tokens != fleet.max_batched_tokens or own.prior is not fleet.prior:
            mix = _Weighed(own, fleet, w)
        else:
            theta = [w * a + (1.0 - w) * b for a, b in zip(own.theta, fleet.theta, strict=True)]
            scale = w * own.decode_scale + (1.0 - w) * fleet.decode_scale
            mix = Curve(own.prior, own.max_batched_tokens, theta, scale)
        self._mix = mix
        return mix

    def ttft_ms(
        self, x_tokens: float, decoding: bool, kv_usage: float, wait_ms: float = 0.0, rest: float = HALF_PASS
    ) -> float:
        return self.curve().ttft_ms(x_tokens, decoding, kv_usage, wait_ms, rest)

    def prefill_ms(self, x_tokens: float) -> float:
        return self.curve().prefill_ms(x_tokens)

    def added_prefill_ms(self, ahead_tokens: float, own_tokens: float) -> float:
        return self.curve().added_prefill_ms(ahead_tokens, own_tokens)

    def decode_ms(self, kv_usage: float) -> float:
        """One decode pass at ``kv_usage``, as this worker's streamed gaps have shown it."""
        return self.own.decode_ms(kv_usage)

    def uncertainty_ms(self, x_tokens: float) -> float:
        """How uncertain the predicted TTFT at ``x_tokens`` is (see :meth:`TimingModel.uncertainty_ms`):
        costs closer than this cannot be told apart."""
        w = self._weight()
        if w <= 0.0:
            return self.fleet.uncertainty_ms(x_tokens)
        own = self.own.uncertainty_ms(x_tokens)
        if w >= 1.0:
            return own
        return w * own + (1.0 - w) * self.fleet.uncertainty_ms(x_tokens)

    def noise_ms(self) -> float:
        """The spread of single TTFTs around the prediction (see :meth:`TimingModel.noise_ms`),
        blended as the prediction is."""
        w = self._weight()  # (the fits' noise_ms inlined: the tail rule asks for it per candidate)
        return MAD_TO_SD * (w * self.own.scale_ms + (1.0 - w) * self.fleet.scale_ms)

    def ms_per_token(self) -> float:
        w = self._weight()
        return w * self.own.ms_per_token() + (1.0 - w) * self.fleet.ms_per_token()

    def observe_ttft(
        self,
        x_tokens: float,
        decoding: bool,
        kv_usage: float,
        ttft_ms: float,
        wait_ms: float = 0.0,
        rest: float = HALF_PASS,
    ) -> None:
        self.own.observe_ttft(x_tokens, decoding, kv_usage, ttft_ms, wait_ms, rest)
        if not self.profiled:
            self.fleet.observe_ttft(x_tokens, decoding, kv_usage, ttft_ms, wait_ms, rest)

    def observe_itl(self, gap_ms: float, kv_usage: float) -> None:
        self.own.observe_itl(gap_ms, kv_usage)
        if not self.profiled:
            self.fleet.observe_itl(gap_ms, kv_usage)

    @property
    def observations(self) -> int:
        return self.own.observations

    def describe(self) -> dict[str, Any]:
        return {
            **self.own.describe(),
            "own_weight": round(self._weight(), 3),
            "not_fitted_memory_wait": self.waited_for_memory,
        }
