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

Each worker has its own counts, shrunk toward the fleet's while it has few (fleets can be mixed:
an engine that defers a request sharing a prefix with one being scheduled to the next step, as
SGLang can, never shows a join, where vLLM and the simulated engine do).

Pure: no clock, no I/O.
"""

from __future__ import annotations

from kvmesh._types import WorkerKey

EDGES_S = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032)
"""Upper edges of the gap bins (seconds from the step's request being routed); beyond the last,
one more bin."""
HALVE_AT = 2000.0
"""When this many requests have been counted, every count is halved, so the statistics follow
the last thousand or two."""
SHRINK = 5.0
"""Requests in a gap bin after which a worker's own share and the fleet's weigh the same."""


class _Counts:
    __slots__ = ("joined", "seen", "total")

    def __init__(self) -> None:
        self.joined = [0.0] * (len(EDGES_S) + 1)
        self.seen = [0.0] * (len(EDGES_S) + 1)
        self.total = 0.0

    def add(self, i: int, joined: bool) -> None:
        self.seen[i] += 1.0
        if joined:
            self.joined[i] += 1.0
        self.total += 1.0
        if self.total >= HALVE_AT:
            self.total /= 2.0
            self.seen = [v / 2.0 for v in self.seen]
            self.joined = [v / 2.0 for v in self.joined]


class Joins:
    """How often a request routed ``gap`` seconds after the request of the step in progress on a
    worker joins that step."""

    __slots__ = ("_fleet", "_workers", "joined")

    def __init__(self) -> None:
        self._fleet = _Counts()
        self._workers: dict[WorkerKey, _Counts] = {}
        self.joined = False
        """Whether any request was seen joining a step (until then every share is 0)."""

    def share(self, worker: WorkerKey, gap_s: float) -> float:
        """The share of requests routed ``gap_s`` after the step's request on ``worker`` that
        joined it: the worker's own, shrunk toward the fleet's while it has seen few (``SHRINK``);
        0 before any was seen (a step in progress cannot be joined, the model's assumption), and
        shrunk toward 0 by one request while few were."""
        i = _bin(gap_s)
        fleet = self._fleet
        seen = fleet.seen[i]
        if seen <= 0.0:
            return 0.0
        prior = fleet.joined[i] / (seen + 1.0)
        own = self._workers.get(worker)
        if own is None:
            return prior
        return (own.joined[i] + SHRINK * prior) / (own.seen[i] + SHRINK)

    def observe(self, worker: WorkerKey, gap_s: float, joined: bool) -> None:
        i = _bin(gap_s)
        self._fleet.add(i, joined)
        own = self._workers.get(worker)
        if own is None:
            own = self._workers[worker] = _Counts()
        own.add(i, joined)
        if joined:
            self.joined = True

    def forget(self, worker: WorkerKey) -> None:
        """A worker left the fleet."""
        self._workers.pop(worker, None)

    def describe(self) -> dict[str, list[float]]:
        """Over the fleet, per gap bin (upper edges in ms, the last open), the requests seen and the
        share that joined, for ``GET /kvmesh/router``."""
        fleet = self._fleet
        return {
            "gap_ms": [e * 1000.0 for e in EDGES_S],
            "seen": [round(v, 1) for v in fleet.seen],
            "joined_share": [
                round(j / v, 3) if v else 0.0 for j, v in zip(fleet.joined, fleet.seen, strict=True)
            ],
        }


def _bin(gap_s: float) -> int:
    for i, edge in enumerate(EDGES_S):
        if gap_s <= edge:
            return i
    return len(EDGES_S)
