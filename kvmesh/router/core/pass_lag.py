"""Where in its decode pass a worker will be when a request routed now reaches it.

Engines take new requests in only between steps, so a request sent to a worker that is decoding
waits for the rest of the pass running there. The router sees when each pass ended: the tokens its
requests there stream at the end of it. A pass is about as long as the gaps between those tokens
(the timing model's ``decode_ms``), so ``since`` the last tokens came, ``pass - since`` of it is
left, and the request waits that long if it got there at once.

It does not: its bytes reach the engine some time after the decision (the forward, the engine
taking the request in), and the tokens reached the router some time after the pass ended. Both
put the engine further into its pass than ``since`` says, by a lag of a millisecond or two on
loopback. A request that looks to arrive just before the pass ends in fact arrives just after the
next one began, and waits a whole pass. (Measured on ``hot-prefix x4`` and ``chat-fits x4``: the
wait left fell from 0.7 of a pass to 0.1 as ``since`` went from 0 to 0.8 of a pass, then jumped
back to 0.8-0.9 of a pass; the router's tokens were about 0.17 of a pass, ~2 ms, behind the
engine's requests.)

The lag depends on the path (the machine, the engine's intake, a replica's distance), so it is
learned: for each request that found a worker decoding with no prefill step running, the part of
its time to first token the curve does not explain is compared with the wait each lag in a grid
would have predicted, and the lag whose predictions spread least around it wins. The spread, not
the error: the curve's fixed overhead absorbs whatever all requests share.

Once the last tokens are longer ago than a pass, the router cannot tell where the engine is (a
longer step is running, a prefill's, or tokens are late): half a pass, the average.

Pure: no clock, no I/O.
"""

from __future__ import annotations

import math

from kvmesh.router.core.timing import HALF_PASS

LAGS_MS = tuple(0.25 * i for i in range(33))
"""The lags tried (0 to 8 ms)."""
ALPHA = 0.02
"""EWMA weight of each observation in the lags' statistics: they follow the last ~50 requests."""
MIN_SEEN = 50
"""Requests observed before the learned lag is used (until then: no lag)."""


def _rest(since_ms: float, pass_ms: float, lag_ms: float) -> float:
    """The share of the pass left when the request gets there (``since_ms < pass_ms``)."""
    phase = (max(since_ms, 0.0) + lag_ms) / pass_ms
    return 1.0 - (phase - int(phase))


class PassLag:
    """The fleet's lag between the pass boundaries the router sees and the engines' (see the
    module docstring)."""

    __slots__ = ("_mean", "_spread", "lag_ms", "seen")

    def __init__(self) -> None:
        self._mean = [0.0] * len(LAGS_MS)
        self._spread = [0.0] * len(LAGS_MS)
        self.lag_ms = 0.0
        self.seen = 0

    def rest(self, since_ms: float, pass_ms: float) -> float:
        """The share of a decode pass a request routed now waits for on a worker whose last tokens
        came ``since_ms`` ago, its passes ``pass_ms`` long."""
        if not since_ms < pass_ms:  # (inf and nan as well: no tokens seen, or no pass known)
            return HALF_PASS
        return _rest(since_ms, pass_ms, self.lag_ms)

    def observe(self, since_ms: float, pass_ms: float, unexplained_ms: float) -> None:
        """A request routed ``since_ms`` after its worker's last tokens (within a pass) showed
        ``unexplained_ms`` more to its first token than the curve predicts with no pass left."""
        if not (0.0 <= since_ms < pass_ms and math.isfinite(unexplained_ms)):
            return
        mean, spread = self._mean, self._spread
        first = self.seen == 0
        for j, lag in enumerate(LAGS_MS):
            e = unexplained_ms - pass_ms * _rest(since_ms, pass_ms, lag)
            if first:
                mean[j] = e
            else:
                spread[j] += ALPHA * (abs(e - mean[j]) - spread[j])
                mean[j] += ALPHA * (e - mean[j])
        self.seen += 1
        if self.seen >= MIN_SEEN:
            self.lag_ms = LAGS_MS[spread.index(min(spread))]

    def describe(self) -> dict[str, float | int]:
        """For ``GET /kvmesh/router``: the lag in use and the requests it was learned from."""
        return {"lag_ms": self.lag_ms, "requests": self.seen}
