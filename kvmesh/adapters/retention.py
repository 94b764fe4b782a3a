"""Which cached blocks kvmesh keeps resident in an engine, for whom, until when, within a budget.

Two kinds of holders share one ledger:

* a **pin** (``pin_prefix``) holds the cached blocks of a token prefix for a fixed TTL;
* an **open session** holds its conversation's prefix; every turn replaces the held blocks with
  the new (longer) prefix and slides the deadline; closing or timing out releases them.

The ledger is engine-agnostic bookkeeping: it never touches a block pool and never reads the
clock (``now`` is passed in). For every change it answers which blocks the engine adapter must
take a reference on and which it must drop, in that order (acquire first, so a block shared by
the old and the new hold never becomes evictable in between). Each hold owns exactly one engine
reference per block it holds, so the adapter's ref counts always mirror the ledger.

The budget counts *distinct* blocks across all holds: two pins of prefixes that share a system
prompt cost the shared blocks once. When a hold does not fit, it keeps the longest prefix that
does (a prefix's head is worth more than its tail: every later turn reuses it).
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from itertools import count
from typing import Generic, TypeVar

__all__ = ["HoldChange", "RetentionLedger", "SessionTable"]

B = TypeVar("B", bound=Hashable)


@dataclass(frozen=True, slots=True)
class HoldChange(Generic[B]):
    """What the engine must do after a ledger change: take a reference on every block of
    ``acquire``, then drop one on every block of ``release``. ``held`` is the holder's new size."""

    acquire: tuple[B, ...]
    release: tuple[B, ...]
    held: int


@dataclass(slots=True)
class _Hold(Generic[B]):
    blocks: tuple[B, ...]
    expires_at: float


class RetentionLedger(Generic[B]):
    """Holds keyed by an owner (any hashable), each with blocks and an expiry time."""

    def __init__(self, budget_blocks: int) -> None:
        if budget_blocks < 0:
            raise ValueError(f"budget_blocks must be >= 0, got {budget_blocks}")
        self.budget_blocks = budget_blocks
        self._holds: dict[Hashable, _Hold[B]] = {}
        self._refs: dict[B, int] = {}  # block -> number of holds that contain it
        self._deadlines: list[tuple[float, int, Hashable]] = []  # lazy heap; stale entries skipped
        self._tie = count()

    @property
    def held_blocks(self) -> int:
        """Distinct blocks held by all owners together (what the budget limits)."""
        return len(self._refs)

    def __contains__(self, owner: Hashable) -> bool:
        return owner in self._holds

    def __len__(self) -> int:
        return len(self._holds)

    def blocks_of(self, owner: Hashable) -> tuple[B, ...]:
        hold = self._holds.get(owner)
        return hold.blocks if hold is not None else ()

    def expiry_of(self, owner: Hashable) -> float | None:
        hold = self._holds.get(owner)
        return hold.expires_at if hold is not None else None

    def hold(self, owner: Hashable, blocks: Sequence[B], expires_at: float) -> HoldChange[B]:
        """Make ``owner`` hold the longest prefix of ``blocks`` that fits in the budget (replacing
        what it held before) until ``expires_at``."""
        old = self._holds.get(owner)
        old_blocks = set(old.blocks) if old is not None else set()
        refs = self._refs
        # Distinct blocks that stay held by *other* owners whatever this owner does.
        others = len(refs) - sum(1 for b in old_blocks if refs[b] == 1)
        room = self.budget_blocks - others
        kept: list[B] = []
        seen: set[B] = set()
        for block in blocks:
            if block in seen:
                continue
            held_by_others = refs.get(block, 0) - (1 if block in old_blocks else 0) > 0
            if not held_by_others:
                if room == 0:
                    break  # keep a prefix: a hole would strand the blocks after it
                room -= 1
            seen.add(block)
            kept.append(block)
        new_blocks = tuple(kept)
        if old is not None and old.blocks == new_blocks:
            self._set_expiry(owner, old, expires_at)
            return HoldChange((), (), len(new_blocks))
        for block in new_blocks:
            refs[block] = refs.get(block, 0) + 1
        released = old.blocks if old is not None else ()
        self._unref(released)
        hold = _Hold(new_blocks, expires_at)
        self._holds[owner] = hold
        heapq.heappush(self._deadlines, (expires_at, next(self._tie), owner))
        return HoldChange(new_blocks, released, len(new_blocks))

    def extend(self, owner: Hashable, expires_at: float) -> bool:
        """Move ``owner``'s deadline (blocks unchanged); False when it holds nothing."""
        hold = self._holds.get(owner)
        if hold is None:
            return False
        self._set_expiry(owner, hold, expires_at)
        return True

    def release(self, owner: Hashable) -> tuple[B, ...]:
        """Drop ``owner``'s hold; returns the blocks whose reference the engine must drop."""
        hold = self._holds.pop(owner, None)
        if hold is None:
            return ()
        self._unref(hold.blocks)
        return hold.blocks

    def expire(self, now: float) -> list[tuple[Hashable, tuple[B, ...]]]:
        """Release every hold whose deadline is at or before ``now``, earliest first."""
        out: list[tuple[Hashable, tuple[B, ...]]] = []
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            deadline, _, owner = heapq.heappop(heap)
            hold = self._holds.get(owner)
            if hold is None or hold.expires_at != deadline:
                continue  # released or moved since this entry was pushed
            out.append((owner, self.release(owner)))
        return out

    def next_expiry(self) -> float | None:
        """The earliest live deadline, or None when nothing is held."""
        heap = self._deadlines
        while heap:
            deadline, _, owner = heap[0]
            hold = self._holds.get(owner)
            if hold is not None and hold.expires_at == deadline:
                return deadline
            heapq.heappop(heap)
        return None

    def _set_expiry(self, owner: Hashable, hold: _Hold[B], expires_at: float) -> None:
        if expires_at != hold.expires_at:
            hold.expires_at = expires_at
            heapq.heappush(self._deadlines, (expires_at, next(self._tie), owner))

    def _unref(self, blocks: Sequence[B]) -> None:
        refs = self._refs
        for block in blocks:
            n = refs[block] - 1
            if n:
                refs[block] = n
            else:
                del refs[block]


class SessionTable:
    """Open sessions and their idle timeouts (the sliding part of a session's hold)."""

    def __init__(self, max_sessions: int = 100_000) -> None:
        self.max_sessions = max_sessions
        self._timeouts: dict[str, float] = {}

    def open(self, session_id: str, timeout: float) -> bool:
        """Register (or re-open with a new timeout); False when the table is full."""
        if session_id not in self._timeouts and len(self._timeouts) >= self.max_sessions:
            return False
        self._timeouts[session_id] = timeout
        return True

    def timeout_of(self, session_id: str) -> float | None:
        return self._timeouts.get(session_id)

    def close(self, session_id: str) -> bool:
        return self._timeouts.pop(session_id, None) is not None

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._timeouts

    def __len__(self) -> int:
        return len(self._timeouts)
