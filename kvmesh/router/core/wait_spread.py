"""How far the predicted waits for KV memory are from the waits requests then have.

Where the blocks in flight on a worker exceed its cache, the latency cost predicts the wait for
the requests ahead to free enough of them (``LatencyCost.memory_wait_ms``): their expected
finishing times, their blocks coming back whole at the end. The engine does not keep to that
picture (it allocates a long prompt's blocks chunk by chunk, preempts the most recently admitted
request when a running one needs a block, reuses what is freed at once), and the finishing times
are themselves estimates, so a predicted wait comes true only to within a share of itself. That
share is learned here, over the fleet (the waits come from the engines' schedulers, which a
fleet's engines share): each request that was predicted to wait gives its observed wait (its
time to first token less the rest of its prediction) against the predicted one.

The spread is the root mean square of the errors relative to the predictions, weighted by the
predictions' size (long waits decide where requests go; a 20 ms wait off by 200% decides
nothing). It is the width of a wait's prediction, not a correction of its mean: a correction by
size cannot be learned, since the router avoids the workers with the longest predicted waits and
never sees how those would have come out, but how far off a prediction is at the sizes it does
see carries over to the sizes it avoids.

(Measured on 12-turn agents on four engines past their caches: waits predicted at 0.6-2 s came
in at 0.9 of the prediction on average with a relative spread of 0.3; over all sizes, weighted,
0.45-0.5.)

Pure: no clock, no I/O.
"""

from __future__ import annotations

import math

PRIOR = 0.5
"""The relative spread before any wait was seen: what it was on 12-turn agents past their
caches, over all sizes (0.45-0.5); the fleet's own waits replace it."""
SHRINK = 8.0
"""Requests after which the learned spread and the prior weigh the same."""
HALVE_AT = 400.0
"""When this many requests have been counted, the sums are halved (they follow the last few
hundred)."""
CLIP = 4.0
"""An observed wait counts at most this many times its prediction (a request that met a stalled
step as well is not the memory model's error alone)."""


class WaitSpread:
    """The relative spread of observed around predicted waits for memory, over the fleet."""

    __slots__ = ("_n", "_squared_error", "_squared_predicted", "relative")

    def __init__(self) -> None:
        self._n = 0.0
        self._squared_error = 0.0
        self._squared_predicted = 0.0
        self.relative = PRIOR
        """The spread in use, as a share of a predicted wait (kept current by :meth:`observe`:
        it is read for every candidate of a decision where a wait was predicted)."""

    def observe(self, predicted_ms: float, observed_ms: float) -> None:
        """One request predicted to wait ``predicted_ms`` for memory waited ``observed_ms``."""
        if not (predicted_ms > 0.0 and math.isfinite(observed_ms)):
            return
        observed = min(max(observed_ms, 0.0), CLIP * predicted_ms)
        self._n += 1.0
        self._squared_error += (observed - predicted_ms) ** 2
        self._squared_predicted += predicted_ms * predicted_ms
        if self._n >= HALVE_AT:
            self._n /= 2.0
            self._squared_error /= 2.0
            self._squared_predicted /= 2.0
        # the prior weighs as SHRINK requests of the mean size seen
        prior = SHRINK * self._squared_predicted / self._n
        self.relative = math.sqrt(
            (self._squared_error + PRIOR * PRIOR * prior) / (self._squared_predicted + prior)
        )

    def width_ms(self, predicted_ms: float) -> float:
        """One standard deviation of a wait predicted at ``predicted_ms``."""
        return self.relative * predicted_ms if predicted_ms > 0.0 else 0.0

    def describe(self) -> dict[str, float]:
        """For ``GET /kvmesh/router``: the waits the spread rests on (halved with the sums at
        ``HALVE_AT``, so a weight, not a running total) and the relative spread in use."""
        return {"requests": round(self._n, 1), "relative_spread": round(self.relative, 3)}
