"""The tail of the fleet's times to first token, as the router has been seeing it.

The latency cost adds to a candidate's own predicted time to first token what placing the request
there does to others: the cache it evicts, the delay its prefill causes the requests arriving
there. Those are expectations over many later requests, each touched a little; the request's own
time is one request's, all of it. Under heavy cache pressure the two can trade badly for the
tail: ten-turn chats on four engines past their caches (stop 49's held-out case H1) priced every
candidate's evictions at 4-13 s, and differences between them of a second or two sent turns where
they were predicted to wait 400-970 ms for memory while 100-130 ms was on offer elsewhere. Their
mean and prefix hits beat Dynamo's cost; their p99 did not (1.63x).

So :meth:`LatencyCost.pick_saving_work` does not send a request beyond the tail the fleet is
showing when another candidate keeps it within: the bound is the 99th percentile of the last
:data:`WINDOW` times to first token observed (the same measure the predictions are of: from
dispatch to the first token), the quantile the routing targets are stated in. A candidate counts
as beyond it only when its prediction less its spread is (see the method); until
:data:`MIN_SEEN` requests have been seen there is no bound.

Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections import deque

QUANTILE = 0.99
"""The tail the bound is drawn at: the quantile the routing targets name (TTFT p99)."""
WINDOW = 1000
"""Times to first token the bound is taken over, the latest ones: it follows the traffic."""
MIN_SEEN = 200
"""Observations before there is a bound (fewer put a 99th percentile at the slowest one seen)."""
EVERY = 25
"""Observations between recomputations of the bound (a sort of the window)."""


class TtftTail:
    """The running :data:`QUANTILE` of the observed times to first token, in ms."""

    __slots__ = ("_recent", "_seen", "bound_ms")

    def __init__(self) -> None:
        self._recent: deque[float] = deque(maxlen=WINDOW)
        self._seen = 0
        self.bound_ms: float | None = None
        """The tail's bound (None until :data:`MIN_SEEN` requests were seen): read for every
        decision of the latency cost."""

    def observe(self, ttft_ms: float) -> None:
        """One request's time to first token, from its dispatch."""
        if not ttft_ms >= 0.0:  # (NaN too)
            return
        self._recent.append(ttft_ms)
        self._seen += 1
        if len(self._recent) >= MIN_SEEN and (self.bound_ms is None or self._seen % EVERY == 0):
            ordered = sorted(self._recent)
            self.bound_ms = ordered[int(QUANTILE * (len(ordered) - 1))]

    def describe(self) -> dict[str, float | int | None]:
        """For ``GET /kvmesh/router``: the requests seen and the bound in use."""
        bound = self.bound_ms
        return {"requests": self._seen, "p99_ms": None if bound is None else round(bound, 1)}
