"""The fleet's request arrival rate, as the latency cost needs it for the delay a request's work
imposes on the requests that will arrive behind it (see ``KvRouter._externality_ms``).

A decayed count: each arrival adds 1, the count fades as ``exp(-dt / HORIZON_S)``, and the rate is
``count / HORIZON_S``. Unlike an average of the gaps between arrivals, a burst of requests at one
instant gives a finite rate, and an idle fleet's rate falls to zero by itself.

Pure: time is passed in.
"""

from __future__ import annotations

import math

HORIZON_S = 2.0
"""Seconds the count remembers. The rate matters over the next queue's length (a prefill of tens
to hundreds of ms); a horizon of a few of those holds enough arrivals to estimate it at any load
where queueing matters, and follows a change of load within seconds."""


class ArrivalRate:
    """Requests per second over the recent past (a decayed count). Not thread-safe."""

    __slots__ = ("_at", "_count")

    def __init__(self) -> None:
        self._count = 0.0
        self._at: float | None = None

    def arrive(self, now: float) -> None:
        self._count = self._decayed(now) + 1.0
        self._at = now if self._at is None else max(self._at, now)

    def per_second(self, now: float) -> float:
        return self._decayed(now) / HORIZON_S

    def _decayed(self, now: float) -> float:
        if self._at is None:
            return 0.0
        return self._count * math.exp(-max(now - self._at, 0.0) / HORIZON_S)
