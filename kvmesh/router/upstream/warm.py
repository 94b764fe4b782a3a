"""Connections kept ready per worker for the bursts it has had lately.

HTTP/1.1 carries one request per connection at a time, so a burst of ``n`` requests to one worker
(best-of-n samples, parallel tool calls) needs ``n`` connections at once. The pool keeps a
connection for ``max_idle_secs`` after its last answer (below the engines' keep-alive timeout), so
after a quiet moment, or the first time a worker takes that many at once, a burst's later
requests each opened a connection. A fresh connection took the front's event loop two passes
before the request could be written, each behind every other request read with it (3 ms at the
median for a burst's siblings on four engines, 8 ms on six, up to 33), and it took the engine an
accept before it read the request. Those siblings reached their engine after the step their first
request had started alone, and waited for it.

:func:`keep_warm` opens connections ahead of need: every ``tick_secs``, for each worker, as many
as were busy at once in the last ``remember_secs`` (:meth:`ConnectionPool.warm_targets`), less
the busy ones and the idle ones still young enough to be reused. The connections opened this way
replace themselves as they age, which costs one connect per warm connection and pool lifetime
(about 1.5 s) while a worker is busy; a worker that has had no traffic for ``remember_secs`` gets
none. Measured on the routing-quality suite's ``siblings`` (kvmesh alone, with and without, eight
seeds each): bursts of four p50 0.970 (lower on 7 of 8), bursts of six 0.962, where a sibling ran in
its first request's step 4.3 points more often (on 8 of 8).
"""

from __future__ import annotations

import asyncio
import contextlib

from kvmesh.router.upstream.connection import ConnectionPool

TICK_SECS = 0.25
REMEMBER_SECS = 30.0
MAX_OPEN_PER_TICK = 64
"""Connections opened at most per tick, over every worker (a fleet coming back all at once)."""


async def keep_warm(
    pool: ConnectionPool, *, tick_secs: float = TICK_SECS, remember_secs: float = REMEMBER_SECS
) -> None:
    """Run until cancelled (see the module). A pool whose connections live no longer than two
    ticks keeps none warm: they would be stale before they were used."""
    loop = asyncio.get_running_loop()
    margin = 2 * tick_secs
    while True:
        await asyncio.sleep(tick_secs)
        if pool.max_idle_secs <= margin:
            continue
        budget = MAX_OPEN_PER_TICK
        for origin, missing in pool.warm_targets(loop.time(), remember_secs, margin):
            n = min(missing, budget)
            if n <= 0:
                break
            budget -= n
            opened = await asyncio.gather(*(pool.connect(origin) for _ in range(n)), return_exceptions=True)
            for conn in opened:
                if isinstance(conn, Exception):
                    # A worker that refuses is the registry's to notice (its health checks), and
                    # gets no more warm connections until it carries requests again.
                    pool.forget_peak(origin)
                elif isinstance(conn, BaseException):
                    raise conn
                else:
                    pool.park(origin, conn)


async def stop(task: asyncio.Task[None] | None) -> None:
    """Cancel a :func:`keep_warm` task and wait for it to end."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
