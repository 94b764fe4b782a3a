"""How long the router's requests stay on a worker, and what they leave behind: learned as they finish.

The latency cost divides by these. The requests in flight on a worker over their time there are the
rate requests arrive (Little's law); a request's time from first token to finish is how long its
blocks stay; the output tokens a request generates and the share of prompts found cached say how
soon blocks come back and how likely evicted cache is to be asked for again. Each is a moving
average (a weight of ``ALPHA`` on every new request), per worker where workers differ and over the
fleet for a worker seen little.
"""

from __future__ import annotations

from kvmesh._types import WorkerKey

ALPHA = 0.05
"""Weight of each finished request in the moving averages: about the last 20 count."""


class Stays:
    """The moving averages above. Read the attributes; only the methods below change them."""

    __slots__ = (
        "_seen_reuse",
        "decode_fleet",
        "decode_s",
        "first_dispatch",
        "in_system_fleet",
        "in_system_s",
        "out_tokens",
        "reuse_fleet",
    )

    def __init__(self) -> None:
        self.decode_s: dict[WorkerKey, float] = {}
        """Per worker, a request's time from first token to finish (seconds)."""
        self.decode_fleet = 0.0
        self.in_system_s: dict[WorkerKey, float] = {}
        """Per worker, a request's time from dispatch to finish: its whole stay, the queue and the
        wait for memory included (what Little's law divides the requests in flight by)."""
        self.in_system_fleet = 0.0
        self.out_tokens = 0.0
        """Output tokens a request generates, fleet-wide."""
        self.reuse_fleet = 0.0
        """The engine-reported prefix hit share over the fleet: how likely cached blocks are to be
        asked for again (what evicting them costs)."""
        self._seen_reuse = False
        self.first_dispatch = -1.0
        """When the router dispatched its first request (-1: none yet)."""

    def dispatched(self, now: float) -> None:
        """A request was dispatched at ``now``."""
        if self.first_dispatch < 0.0:
            self.first_dispatch = now

    def fleet_stay(self, now: float) -> float:
        """A request's whole stay over the fleet, from dispatch to finish; before any request has
        finished, the time since the first one was dispatched (0 before that). Until one finishes,
        every request is still in flight, so the requests in flight over that time are exactly
        the rate they came in (Little's law with none gone yet); after, Little's law divides them
        by the whole stay, not by the time from first token to finish, which leaves out the queue
        and the prefill and read the rate higher than it was. (With no stay before the first
        finish, a new hot prefix had no rate and no copy was worth anything: on a fleet of 6 whose
        questions arrived at 30/s, 95% of them on one 2.8k-token prefix, 44 of the first second's
        53 queued on its one worker, at 60-110 ms to first token where a copy elsewhere took 82-87.)"""
        if self.in_system_fleet > 0.0:
            return self.in_system_fleet
        if self.first_dispatch < 0.0:
            return 0.0
        return max(now - self.first_dispatch, 0.0)

    def decode_of(self, worker: WorkerKey) -> float:
        """A request's time from first token to finish on ``worker`` (the fleet's until it has one)."""
        return self.decode_s.get(worker, self.decode_fleet)

    def generated(self, tokens: int) -> None:
        """A request generated ``tokens`` output tokens (more than 0)."""
        old = self.out_tokens
        self.out_tokens = tokens if not old else old + ALPHA * (tokens - old)

    def hit(self, share: float) -> None:
        """The engine reported this share of a request's prompt cached."""
        if self._seen_reuse:
            self.reuse_fleet += ALPHA * (share - self.reuse_fleet)
        else:
            self.reuse_fleet, self._seen_reuse = share, True

    def finished(self, worker: WorkerKey, decode_s: float, in_system_s: float) -> None:
        """A request on ``worker`` took ``decode_s`` from first token to finish, ``in_system_s``
        from dispatch to finish."""
        self.decode_fleet = _follow(self.decode_s, self.decode_fleet, worker, decode_s)
        self.in_system_fleet = _follow(self.in_system_s, self.in_system_fleet, worker, in_system_s)

    def forget(self, worker: WorkerKey) -> None:
        self.decode_s.pop(worker, None)
        self.in_system_s.pop(worker, None)


def _follow(per_worker: dict[WorkerKey, float], fleet: float, worker: WorkerKey, value: float) -> float:
    """Move ``worker``'s moving average in ``per_worker`` toward ``value`` (its first value taken
    whole) and return the fleet's, moved likewise (taken whole while it is still 0 and the worker
    is new)."""
    old = per_worker.get(worker)
    per_worker[worker] = value if old is None else old + ALPHA * (value - old)
    if old is None and fleet == 0.0:
        return value
    return fleet + ALPHA * (value - fleet)
