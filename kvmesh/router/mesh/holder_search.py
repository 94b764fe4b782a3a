"""Searches of the fleet for the one engine holding something (a stored response, an SGLang
session) that this router was not told of: one at a time per thing, and a short memory of
those nobody held.

Such a search asks every routable worker at once (``kvmesh.router.asgi.stored_responses``,
``kvmesh.router.asgi.sglang_sessions``). Before, every request naming an id the router did not
know searched again: a client polling ``GET /v1/responses/{id}`` for a response no engine kept
(vLLM with its store off), a burst of siblings continuing one unknown ``previous_response_id``,
or a client sending made-up ids, cost one request to every engine each, 64 on a fleet of 64.
Now requests naming the same id while its search runs wait for that search, and an id that
nobody held is answered as not held, without asking, for :data:`MISS_MEMORY_S`.

A miss is remembered only when every worker asked answered: one that could not be reached, or did
not answer in time, may hold the id (the search raises :class:`Unanswered`, its waiters get None,
and the next request searches again).

Forgetting a miss that soon matters little: an id reaches a client only once its engine holds it,
and what this router relays or a replica tells it (``ResponseHomes``) is looked up before the
memory of misses is. Nothing here is a worker's answer kept past that: a holder found is
remembered where it always was, in the homes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass

MISS_MEMORY_S = 2.0
"""Seconds an id that no worker held is answered as not held without asking again."""
MISSES_KEPT = 10_000
"""Misses remembered at most (the oldest go first): a client sending made-up ids grows nothing."""


class Unanswered(Exception):
    """A search found no holder, but not every worker answered: not a miss to remember."""


@dataclass
class SearchCounts:
    """How the searches went, for ``/metrics``: ``searched`` asked the fleet (``found`` of them
    found a holder), ``joined`` waited for a search already running, ``remembered`` was answered
    from the memory of misses."""

    searched: int = 0
    found: int = 0
    joined: int = 0
    remembered: int = 0


class HolderSearch:
    """One search per key at a time; keys nobody held remembered for ``miss_memory_s``."""

    def __init__(
        self,
        *,
        miss_memory_s: float = MISS_MEMORY_S,
        capacity: int = MISSES_KEPT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._memory = miss_memory_s
        self._capacity = capacity
        self._clock = clock
        self._running: dict[Hashable, asyncio.Future[str | None]] = {}
        self._misses: dict[Hashable, float] = {}  # key -> when it stops counting (oldest first)
        self.counts: dict[str, SearchCounts] = {}

    async def find(self, kind: str, key: Hashable, search: Callable[[], Awaitable[str | None]]) -> str | None:
        """The holder ``search`` finds for ``key`` (a ``kind`` of thing), or None: a search
        already running for it is waited for, a recent miss is answered without one. A caller
        that leaves does not stop a search others wait for."""
        counts = self.counts.setdefault(kind, SearchCounts())
        full_key = (kind, key)
        until = self._misses.get(full_key)
        if until is not None:
            if self._clock() < until:
                counts.remembered += 1
                return None
            del self._misses[full_key]
        running = self._running.get(full_key)
        if running is None:
            counts.searched += 1
            running = asyncio.ensure_future(search())
            self._running[full_key] = running
            running.add_done_callback(lambda done: self._settle(full_key, done, counts))
        else:
            counts.joined += 1
        try:
            return await asyncio.shield(running)
        except Unanswered:
            return None

    def _settle(self, key: Hashable, done: asyncio.Future[str | None], counts: SearchCounts) -> None:
        self._running.pop(key, None)
        if done.cancelled() or done.exception() is not None:
            return  # (no answer: the next request searches again)
        if done.result() is not None:
            counts.found += 1
            return
        misses = self._misses
        misses.pop(key, None)  # (a re-insert makes it the newest)
        misses[key] = self._clock() + self._memory
        while len(misses) > self._capacity:
            del misses[next(iter(misses))]

    def __len__(self) -> int:
        """Misses remembered (some may have run out)."""
        return len(self._misses)
