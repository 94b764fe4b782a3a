"""The tail of the times to first token the fleet could give, as the router has been seeing it.

The latency cost adds to a candidate's own predicted time to first token what placing the request
there does to others: the cache it evicts, the delay its prefill causes the requests arriving
there. Those are expectations over many later requests, each touched a little; the request's own
time is one request's, all of it. Under heavy cache pressure the two can trade badly for the
tail: ten-turn chats on four engines past their caches (stop 49's held-out case H1) priced every
candidate's evictions at 4-13 s, and differences between them of a second or two sent turns where
they were predicted to wait 400-970 ms for memory while 100-130 ms was on offer elsewhere. Their
mean and prefix hits beat Dynamo's cost; their p99 did not (1.63x).

So :meth:`LatencyCost.pick_saving_work` does not send a request surely beyond the tail the fleet
could have given: the bound is the 99th percentile, over the last :data:`WINDOW` decisions, of the
best time to first token on offer at each (the least predicted over its candidates), the quantile
the routing targets are stated in. The best offers are predictions, as the candidates' are, so one
is held against the other in the same units, however far the fitted curves are off. (The bound
was first the 99th percentile of the times to first token observed. Those are the outcome of the
router's own choices: when it had sent turns to wait for memory, the tail they made raised the
bound to 394 ms and nothing was left out any more (p99 401 ms on that draw of H1, 178 with the
bound drawn from the offers); and on a fleet that kept its tail short, a bound of 101-119 ms was
below every candidate of a crowded moment, so the rule stood aside there.) Until
:data:`MIN_SEEN` decisions have been made there is no bound.

The observed times are kept beside it, to be shown: a tail observed far past the one on offer
says the predictions miss where the time goes.

Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections import deque

QUANTILE = 0.99
"""The tail the bound is drawn at: the quantile the routing targets name (TTFT p99)."""
WINDOW = 1000
"""Values the quantile is taken over, the latest ones: it follows the traffic."""
MIN_SEEN = 200
"""Values before there is a quantile (fewer put a 99th percentile at the largest one seen)."""
EVERY = 25
"""Values between recomputations of the quantile (a sort of the window)."""


class RunningQuantile:
    """The :data:`QUANTILE` of the last :data:`WINDOW` values added (None until :data:`MIN_SEEN`)."""

    __slots__ = ("_recent", "seen", "value")

    def __init__(self) -> None:
        self._recent: deque[float] = deque(maxlen=WINDOW)
        self.seen = 0
        self.value: float | None = None

    def add(self, x: float) -> None:
        if x != x:  # NaN: it has no place in an order, and sorted with it the window has none
            return
        self._recent.append(x)
        self.seen += 1
        if self.seen >= MIN_SEEN and (self.value is None or self.seen % EVERY == 0):
            ordered = sorted(self._recent)
            self.value = ordered[int(QUANTILE * (len(ordered) - 1))]

    def rounded(self) -> float | None:
        return None if self.value is None else round(self.value, 1)


class TtftTail:
    """The tail bound (:attr:`bound_ms`) and the observed tail shown beside it, in ms."""

    __slots__ = ("_observed", "_offered")

    def __init__(self) -> None:
        self._observed = RunningQuantile()
        self._offered = RunningQuantile()

    @property
    def bound_ms(self) -> float | None:
        """The 99th percentile of the best predicted times to first token on offer (None until
        :data:`MIN_SEEN` decisions): read for every decision of the latency cost."""
        return self._offered.value

    def offer(self, best_ms: float) -> None:
        """A decision's best offer: the least predicted time to first token over its candidates."""
        self._offered.add(best_ms)

    def observe(self, ttft_ms: float) -> None:
        """One request's time to first token, from its dispatch."""
        if ttft_ms >= 0.0:  # (a negative time is no time)
            self._observed.add(ttft_ms)

    def describe(self) -> dict[str, float | int | None]:
        """For ``GET /kvmesh/router``: the decisions and their offers' tail (the bound in use),
        the requests timed and their tail."""
        return {
            "decisions": self._offered.seen,
            "offered_p99_ms": self._offered.rounded(),
            "requests": self._observed.seen,
            "p99_ms": self._observed.rounded(),
        }
