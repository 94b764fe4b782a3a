"""Requests that reach a prefill step before it starts: how often they join it, by how soon after
the request it runs for they were routed.

The latency cost takes the oldest request in prefill on a worker to be in the engine step running
there, which a request routed now cannot join: it waits for the rest of that step, then runs its
own. But a step starts only once its request has reached the engine and the engine has taken it
in (the forward, the engine's own parsing and tokenizing): a request routed a moment after it can
get there first, and is admitted into the same step. Whether it does depends on the engine (how
it takes arrivals in between steps) and on the path to it, so the router learns it: for a request
routed while another was the step in progress there, it compares when the two showed their first
tokens. The same step emits both; a step of its own comes at least one step later.

(Measured on ``siblings x4``: the three siblings routed within a millisecond of the first were
predicted at 55-78 ms, behind the first one's step, and most showed their first token with it, at
36-40 ms; in the same runs the fit, taught those TTFTs as waits it never had, predicted idle
workers 7-11 ms short, and siblings were sent to recompute the conversation elsewhere.)

Pure: no clock, no I/O. Fleet-wide: the way an engine takes arrivals is the engine's, shared by
the workers of one kind.
"""

from __future__ import annotations

EDGES_S = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032)
"""Upper edges of the gap bins (seconds from the step's request being routed); beyond the last,
one more bin."""
HALVE_AT = 2000.0
"""When this many requests have been counted, every count is halved, so the statistics follow
the last thousand or two."""


class Joins:
    """How often a request routed ``gap`` seconds after the request of the step in progress joins
    that step."""

    __slots__ = ("_joined", "_seen", "_total", "joined")

    def __init__(self) -> None:
        self._joined = [0.0] * (len(EDGES_S) + 1)
        self._seen = [0.0] * (len(EDGES_S) + 1)
        self._total = 0.0
        self.joined = False
        """Whether any request was seen joining a step (until then every share is 0)."""

    def share(self, gap_s: float) -> float:
        """The share of requests routed ``gap_s`` after the step's request that joined it: 0 before
        any was seen (a step in progress cannot be joined, the model's assumption), and shrunk
        toward 0 by one request while few were."""
        i = _bin(gap_s)
        seen = self._seen[i]
        if seen <= 0.0:
            return 0.0
        return self._joined[i] / (seen + 1.0)

    def observe(self, gap_s: float, joined: bool) -> None:
        i = _bin(gap_s)
        self._seen[i] += 1.0
        if joined:
            self._joined[i] += 1.0
            self.joined = True
        self._total += 1.0
        if self._total >= HALVE_AT:
            self._total /= 2.0
            self._seen = [s / 2.0 for s in self._seen]
            self._joined = [j / 2.0 for j in self._joined]

    def describe(self) -> dict[str, list[float]]:
        """Per gap bin (upper edges in ms, the last open), the requests seen and the share that
        joined, for ``GET /kvmesh/router``."""
        return {
            "gap_ms": [e * 1000.0 for e in EDGES_S],
            "seen": [round(s, 1) for s in self._seen],
            "joined_share": [
                round(j / s, 3) if s else 0.0 for j, s in zip(self._joined, self._seen, strict=True)
            ],
        }


def _bin(gap_s: float) -> int:
    for i, edge in enumerate(EDGES_S):
        if gap_s <= edge:
            return i
    return len(EDGES_S)
