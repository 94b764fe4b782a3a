"""Blocks the engine keeps resident on purpose: pinned prefixes (until a TTL) and open sessions.

Both hold an ordinary reference on each block, so the pool never evicts them; dropping the
reference returns a block to the eviction queue (still cached). A budget caps how many distinct
blocks pins and sessions together may hold, so retention can never starve running requests:

* ``pin_prefix`` past the budget fails with :class:`PinBudgetExceeded` and pins nothing;
* a session keeps the longest prefix of its latest request that fits in what is left.

Time is passed in (engine clock, seconds); :meth:`Retention.expire` drops what has run out and
returns the next deadline, so the engine knows when to wake up.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvmesh.errors import RequestError
from kvmesh.mock.block_pool import BlockPool, KVBlock


class PinBudgetExceeded(RequestError):
    """A pin that would take retained blocks past the engine's ``--pin-budget``."""

    status = 409


@dataclass(slots=True)
class Session:
    session_id: str
    timeout: float
    expires: float
    blocks: list[KVBlock] = field(default_factory=list)


class Retention:
    def __init__(self, pool: BlockPool, budget_blocks: int) -> None:
        self.pool = pool
        self.budget_blocks = budget_blocks
        self.pins: dict[KVBlock, float] = {}  # block -> expiry
        self.sessions: dict[str, Session] = {}
        self._holders: dict[KVBlock, int] = {}  # block -> number of pins/sessions holding it
        self._pin_heap: list[tuple[float, int, KVBlock]] = []
        self._session_heap: list[tuple[float, str]] = []

    @property
    def num_retained(self) -> int:
        """Distinct blocks held by pins or sessions."""
        return len(self._holders)

    # --- pins ----------------------------------------------------------------------------------

    def pin(self, blocks: Sequence[KVBlock], ttl: float, now: float) -> int:
        """Keep ``blocks`` resident until ``now + ttl`` (extending earlier pins); return how many."""
        new_distinct = sum(1 for b in blocks if b not in self._holders)
        if self.num_retained + new_distinct > self.budget_blocks:
            raise PinBudgetExceeded(
                f"pin budget exceeded: pinning {new_distinct} more blocks would retain "
                f"{self.num_retained + new_distinct} of {self.pool.num_blocks} blocks; "
                f"the limit is {self.budget_blocks} (--pin-budget)",
                field="token_ids",
            )
        expires = now + ttl
        fresh = [b for b in blocks if b not in self.pins]
        self._hold(fresh)
        for b in blocks:
            if self.pins.get(b, -1.0) < expires:
                self.pins[b] = expires
                heapq.heappush(self._pin_heap, (expires, b.block_id, b))
        return len(blocks)

    # --- sessions ------------------------------------------------------------------------------

    def open_session(self, session_id: str, timeout: float, now: float) -> bool:
        """Open (or refresh) a session; True if it was new."""
        session = self.sessions.get(session_id)
        if session is not None:
            session.timeout = timeout
            self._touch_session(session, now)
            return False
        session = Session(session_id, timeout, now + timeout)
        self.sessions[session_id] = session
        heapq.heappush(self._session_heap, (session.expires, session_id))
        return True

    def close_session(self, session_id: str) -> bool:
        session = self.sessions.pop(session_id, None)
        if session is None:
            return False
        self._release(session.blocks)
        return True

    def retain_for_session(self, session_id: str, blocks: Sequence[KVBlock], now: float) -> int:
        """Make ``blocks`` (a finished request's cached prefix) the session's retained prefix."""
        session = self.sessions.get(session_id)
        if session is None:
            return 0
        old = session.blocks
        own = {b for b in old if self._holders.get(b) == 1}  # retained by this session alone
        # Room left once this session's own blocks are released.
        room = self.budget_blocks - self.num_retained + len(own)
        keep: list[KVBlock] = []
        for b in blocks:
            if b not in self._holders or b in own:
                if room == 0:
                    break
                room -= 1
            keep.append(b)
        self._hold(keep)  # before releasing the old ones, so shared blocks never become free
        self._release(old)
        session.blocks = keep
        self._touch_session(session, now)
        return len(keep)

    def _touch_session(self, session: Session, now: float) -> None:
        session.expires = now + session.timeout
        heapq.heappush(self._session_heap, (session.expires, session.session_id))

    # --- time ----------------------------------------------------------------------------------

    def expire(self, now: float) -> float | None:
        """Drop pins and sessions whose time is up; return the next deadline (None if none)."""
        heap = self._pin_heap
        while heap and heap[0][0] <= now:
            expires, _, block = heapq.heappop(heap)
            if self.pins.get(block) == expires:  # not extended since
                del self.pins[block]
                self._release([block])
        sheap = self._session_heap
        while sheap and sheap[0][0] <= now:
            expires, session_id = heapq.heappop(sheap)
            session = self.sessions.get(session_id)
            if session is not None and session.expires == expires:
                self.close_session(session_id)
        deadlines = [h[0][0] for h in (heap, sheap) if h]
        return min(deadlines) if deadlines else None

    # --- references ----------------------------------------------------------------------------

    def _hold(self, blocks: Sequence[KVBlock]) -> None:
        self.pool.touch(blocks)
        holders = self._holders
        for b in blocks:
            holders[b] = holders.get(b, 0) + 1

    def _release(self, blocks: Sequence[KVBlock]) -> None:
        holders = self._holders
        for b in blocks:
            n = holders[b] - 1
            if n:
                holders[b] = n
            else:
                del holders[b]
        self.pool.free(reversed(blocks))
