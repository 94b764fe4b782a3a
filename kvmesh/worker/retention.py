"""Which cached blocks a worker keeps resident on purpose, for whom, until when, within a budget.

Two kinds of holders share one ledger:

* a **pin** (``pin_prefix``) holds the cached blocks of a token prefix until a deadline; pinning
  the same prefix again extends it, never shortens it;
* an **open session** holds its conversation's cached prefix; every turn replaces the held blocks
  with the new (longer) prefix, and every turn or re-open slides the idle deadline; closing the
  session or letting it time out releases them.

The ledger is engine-agnostic: it never sees a block pool and never reads the clock (``now`` is
passed in). Blocks are whatever hashable handle the engine uses (the mock's block objects, vLLM's
block ids). The engine hands in two callbacks, ``acquire`` (take one reference on each block) and
``release`` (drop one on each), so its reference counts always mirror the ledger: every hold owns
exactly one reference per block it holds. A hold that is replaced acquires its new blocks before
releasing its old ones, so a block in both never becomes evictable in between, and releases go
tail first, so the shared head of a prefix is the last part to become evictable.

The budget counts *distinct* blocks across all holds: two pins of prefixes that share a system
prompt cost the shared blocks once, so retention can never take more than its share of the cache
from running requests. When a hold does not fit:

* a session keeps the longest prefix that fits (a prefix's head is worth the most: every later
  turn reuses it, and a hole would strand the blocks after it);
* a pin follows the ledger's ``on_over_budget`` policy: ``"truncate"`` keeps the longest prefix
  that fits, like a session (the vLLM adapter); ``"reject"`` pins nothing and raises
  :class:`PinBudgetExceeded` (HTTP 409), so the caller learns its pin did not happen (the mock).
"""

from __future__ import annotations

import heapq
import math
import os
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from itertools import count
from types import MappingProxyType
from typing import Generic, Literal, TypeVar

from kvmesh.errors import ConfigError, RequestError

__all__ = ["OverBudgetPolicy", "PinBudgetExceeded", "Retention", "TooManySessions"]

B = TypeVar("B", bound=Hashable)

OverBudgetPolicy = Literal["reject", "truncate"]
"""What a pin that does not fit in the budget does: fail whole, or keep its longest fitting prefix."""

_SESSION = "session"
_PIN = "pin"
_Owner = tuple[str, Hashable]  # ("pin", last block of the prefix) or ("session", session id)


class PinBudgetExceeded(RequestError):
    """A pin that would take retained blocks past the budget (policy ``"reject"``)."""

    status = 409


class TooManySessions(RequestError):
    """An ``open_session`` past the ledger's ``max_sessions``."""

    status = 409


@dataclass(slots=True)
class _Hold(Generic[B]):
    blocks: tuple[B, ...]
    expires_at: float


class Retention(Generic[B]):
    """Pins and open sessions of one engine (one data-parallel rank), within one block budget."""

    def __init__(
        self,
        budget_blocks: int,
        *,
        acquire: Callable[[tuple[B, ...]], object],
        release: Callable[[tuple[B, ...]], object],
        on_over_budget: OverBudgetPolicy,
        total_blocks: int,
        budget_setting: str,
        max_sessions: int | None = None,
    ) -> None:
        """``total_blocks`` (the cache size) and ``budget_setting`` (the flag or variable that sets
        the budget) only serve the :class:`PinBudgetExceeded` message, so it says what to change.
        ``max_sessions`` caps open sessions (None: no cap)."""
        if budget_blocks < 0:
            raise ValueError(f"budget_blocks must be >= 0, got {budget_blocks}")
        if on_over_budget not in ("reject", "truncate"):
            raise ValueError(f"on_over_budget must be 'reject' or 'truncate', got {on_over_budget!r}")
        self.budget_blocks = budget_blocks
        self.on_over_budget: OverBudgetPolicy = on_over_budget
        self.total_blocks = total_blocks
        self.budget_setting = budget_setting
        self.max_sessions = max_sessions
        self._acquire = acquire
        self._release = release
        self._holds: dict[_Owner, _Hold[B]] = {}
        self._refs: dict[B, int] = {}  # block -> number of holds that contain it
        self._sessions: dict[str, float] = {}  # open session -> idle timeout
        self._deadlines: list[tuple[float, int, _Owner]] = []  # lazy heap; stale entries skipped
        self._tie = count()

    # ------------------------------------------------------------------ what is held
    @property
    def num_retained(self) -> int:
        """Distinct blocks held by all pins and sessions together (what the budget limits)."""
        return len(self._refs)

    @property
    def num_holds(self) -> int:
        """Pinned prefixes plus open sessions (a session with nothing cached yet counts too)."""
        return len(self._holds)

    @property
    def sessions(self) -> Mapping[str, float]:
        """Open sessions and their idle timeouts (a read-only view)."""
        return MappingProxyType(self._sessions)

    def session_blocks(self, session_id: str) -> tuple[B, ...]:
        """The blocks a session holds now (empty when it is not open)."""
        hold = self._holds.get((_SESSION, session_id))
        return hold.blocks if hold is not None else ()

    # ------------------------------------------------------------------ pins
    def pin(self, blocks: Sequence[B], ttl: float, now: float) -> int:
        """Hold ``blocks`` (a cached prefix, head first) until ``now + ttl`` or a later deadline an
        earlier pin of the same prefix already has; returns how many blocks are pinned."""
        if not blocks:
            return 0
        # The last block names its whole prefix while it is held (it cannot be evicted and reused).
        owner: _Owner = (_PIN, blocks[-1])
        expires_at = now + ttl
        previous = self._holds.get(owner)
        if previous is not None and previous.expires_at > expires_at:
            expires_at = previous.expires_at
        return self._hold(owner, blocks, expires_at, reject=self.on_over_budget == "reject")

    # ------------------------------------------------------------------ sessions
    def open_session(self, session_id: str, timeout: float, now: float) -> bool:
        """Open a session (or re-open it with a new timeout, which slides its deadline); True if new."""
        created = session_id not in self._sessions
        if created and self.max_sessions is not None and len(self._sessions) >= self.max_sessions:
            raise TooManySessions(f"too many open sessions ({self.max_sessions})", field="session_id")
        self._sessions[session_id] = timeout
        owner: _Owner = (_SESSION, session_id)
        hold = self._holds.get(owner)
        if hold is None:
            # An empty hold: a session with nothing cached yet must still time out.
            self._holds[owner] = hold = _Hold((), now + timeout)
            self._push_deadline(owner, hold.expires_at)
        else:
            self._set_expiry(owner, hold, now + timeout)
        return created

    def touch_session(self, session_id: str, now: float) -> bool:
        """A turn of the session arrived: restart its idle timeout. False if it is not open."""
        timeout = self._sessions.get(session_id)
        if timeout is None:
            return False
        owner: _Owner = (_SESSION, session_id)
        self._set_expiry(owner, self._holds[owner], now + timeout)
        return True

    def retain_for_session(self, session_id: str, blocks: Sequence[B]) -> int:
        """Make ``blocks`` (the cached prefix of the session's newest turn) what the session holds,
        cut to the longest prefix that fits; its deadline is unchanged. Returns how many are held
        (0 when the session is not open)."""
        owner: _Owner = (_SESSION, session_id)
        hold = self._holds.get(owner)
        if hold is None:
            return 0
        return self._hold(owner, blocks, hold.expires_at, reject=False)

    def close_session(self, session_id: str) -> bool:
        """Close a session and release what it holds; False if it was not open."""
        if self._sessions.pop(session_id, None) is None:
            return False
        self._drop((_SESSION, session_id))
        return True

    # ------------------------------------------------------------------ time
    def expire(self, now: float) -> list[str]:
        """Release every pin and session whose deadline is at or before ``now``, earliest first;
        returns the sessions that timed out (now closed)."""
        timed_out: list[str] = []
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            deadline, _, owner = heapq.heappop(heap)
            hold = self._holds.get(owner)
            if hold is None or hold.expires_at != deadline:
                continue  # released or moved since this entry was pushed
            if owner[0] == _SESSION:
                session_id = str(owner[1])
                del self._sessions[session_id]
                timed_out.append(session_id)
            self._drop(owner)
        return timed_out

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

    # ------------------------------------------------------------------ the ledger
    def _hold(self, owner: _Owner, blocks: Sequence[B], expires_at: float, *, reject: bool) -> int:
        """Make ``owner`` hold ``blocks`` (duplicates dropped) until ``expires_at``, replacing what
        it held; over budget it keeps the longest prefix that fits, or with ``reject`` raises."""
        old = self._holds.get(owner)
        old_blocks: tuple[B, ...] = old.blocks if old is not None else ()
        refs = self._refs
        old_set = set(old_blocks)
        # Distinct blocks that stay held by *other* owners whatever this owner does.
        room = self.budget_blocks - (len(refs) - sum(1 for b in old_set if refs[b] == 1))
        kept: list[B] = []
        seen: set[B] = set()
        fits = True
        for block in blocks:
            if block in seen:
                continue
            if refs.get(block, 0) - (block in old_set) <= 0:  # held by nobody else: it costs
                if room <= 0:
                    fits = False
                    break  # keep a prefix: a hole would strand the blocks after it
                room -= 1
            seen.add(block)
            kept.append(block)
        if reject and not fits:
            new = len({b for b in blocks if b not in refs})
            raise PinBudgetExceeded(
                f"pin budget exceeded: pinning {new} more blocks would retain "
                f"{len(refs) + new} of {self.total_blocks} blocks; "
                f"the limit is {self.budget_blocks} ({self.budget_setting})",
                field="token_ids",
            )
        new_blocks = tuple(kept)
        if old is not None and old.blocks == new_blocks:
            self._set_expiry(owner, old, expires_at)
            return len(new_blocks)
        for block in new_blocks:
            refs[block] = refs.get(block, 0) + 1
        if new_blocks:
            self._acquire(new_blocks)
        self._holds[owner] = _Hold(new_blocks, expires_at)
        if old is None or old.expires_at != expires_at:
            self._push_deadline(owner, expires_at)
        self._unref(old_blocks)
        return len(new_blocks)

    def _drop(self, owner: _Owner) -> None:
        hold = self._holds.pop(owner, None)
        if hold is not None:
            self._unref(hold.blocks)

    def _unref(self, blocks: tuple[B, ...]) -> None:
        if not blocks:
            return
        refs = self._refs
        for block in blocks:
            n = refs[block] - 1
            if n:
                refs[block] = n
            else:
                del refs[block]
        self._release(blocks[::-1])  # tail first: the shared head stays longest in the LRU queue

    def _set_expiry(self, owner: _Owner, hold: _Hold[B], expires_at: float) -> None:
        if expires_at != hold.expires_at:
            hold.expires_at = expires_at
            self._push_deadline(owner, expires_at)

    def _push_deadline(self, owner: _Owner, expires_at: float) -> None:
        heapq.heappush(self._deadlines, (expires_at, next(self._tie), owner))


DEFAULT_PIN_BUDGET = 0.25
PIN_BUDGET_ENV = "KVMESH_PIN_BUDGET"
"""Fraction of an engine's KV cache that pins and open sessions together may hold resident."""


def pin_budget_from_env(environ: Mapping[str, str] | None = None) -> float:
    """``KVMESH_PIN_BUDGET`` as every engine adapter reads it; ConfigError naming it when invalid."""
    env = os.environ if environ is None else environ
    text = env.get(PIN_BUDGET_ENV)
    if text is None:
        return DEFAULT_PIN_BUDGET
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{PIN_BUDGET_ENV} must be a fraction between 0 and 1, got {text!r}") from None
    if math.isnan(value) or not 0.0 <= value <= 1.0:
        raise ConfigError(f"{PIN_BUDGET_ENV} must be a fraction between 0 and 1, got {text!r}")
    return value
