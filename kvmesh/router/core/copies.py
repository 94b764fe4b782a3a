"""What a copy of a shared prefix on one more worker is worth to the requests that will share it.

A prefix many requests share (a hot system prompt, a document everyone asks about) is cached on a
few workers, and every request carrying it queues there. Judged one request at a time, a worker
holding it always answers sooner than one that must prefill it cold, so the copies never grow
past the few the prefix started on: each such worker takes a share of the prefix's traffic, and
its requests wait behind each other's prefill steps. Copying the prefix to one more worker costs
one cold prefill, once; it shortens every later request's wait for as long as the prefix stays in
demand. The router weighs both:

* **demand**: the requests in flight that hold the prefix, over how long a request stays
  (Little's law), gives the rate ``lam`` at which requests carrying it arrive;
* **the wait a copy saves**: requests arriving at rate ``r`` on a worker wait on average half of
  each other's prefill steps of ``S`` ms, ``r * S * S / 2`` (the same queueing as the cost's delay
  to arrivals). Spread over ``m`` workers, the prefix's requests wait ``lam^2 S^2 / (2 m)`` ms each
  second in all; one more worker saves ``lam^2 S^2 / (2 m (m + 1))`` of that per second;
* **for how long**: a prefix's demand is expected to last about as long as it has lasted so far
  (the age of its being shared, a Lindy estimate: nothing else about its future is known). A
  prefix that no request in flight carried for longer than a request's stay, and longer than it
  had been shared, starts again at age 0.

The saving over that horizon is credited to the workers that would copy it. The router makes the
copy itself where it can (``RouteRequest.copies_in_background``): when the credit is what picks a
worker that does not hold the prefix, and a holder is the request's own fastest place, the request
goes there and its decision names the copy (``Decision.copy``), which the front sends as a prefill
of the prefix alone. The copy's cold prefill then delays no client's first token. A cold prefix (few
requests share it) or a new one is worth little and is not copied; a prefix shared at a high rate
for a while is copied to one more worker each time the saving beats the cold prefill, and less
as the copies grow, because each further copy saves less.

Pure: no clock, no I/O. Prefixes are named by :class:`~kvmesh.router.core.load.PromptBlocks`
chunk identities.
"""

from __future__ import annotations

from collections import OrderedDict

MAX_PREFIXES = 4096
"""Shared prefixes whose age is remembered; past it the one seen longest ago is forgotten."""


def copy_saving_ms(rate: float, step_ms: float, holders: int, horizon_s: float) -> float:
    """The wait one more copy saves the requests sharing a prefix over ``horizon_s``: they arrive
    at ``rate`` a second, each adding a prefill step of ``step_ms``, spread over ``holders``
    workers that hold it now (see the module docstring)."""
    if rate <= 0.0 or step_ms <= 0.0 or holders <= 0 or horizon_s <= 0.0:
        return 0.0
    step_s = step_ms / 1000.0
    per_second = rate * rate * step_s * step_s / (2.0 * holders * (holders + 1))
    return 1000.0 * per_second * horizon_s


class SharedPrefixes:
    """Since when each prefix has been shared by requests in flight (bounded, oldest forgotten)."""

    __slots__ = ("_seen",)

    def __init__(self) -> None:
        self._seen: OrderedDict[int, tuple[float, float]] = OrderedDict()
        """identity -> (first seen shared, last seen shared), least recently seen first."""

    def age(self, identity: int, now: float, stay_s: float) -> float:
        """Seconds ``identity`` has been shared as of ``now``, counting this sighting; a request
        stays ``stay_s`` (one seen shared at ``last`` was still carried until about then)."""
        seen = self._seen
        entry = seen.get(identity)
        if entry is None:
            first = now
        else:
            first, last = entry
            if now - last > max(last - first, stay_s):  # its demand lapsed
                first = now
            seen.move_to_end(identity)
        seen[identity] = (first, now)
        if len(seen) > MAX_PREFIXES:
            seen.popitem(last=False)
        return now - first

    def __len__(self) -> int:
        return len(self._seen)
