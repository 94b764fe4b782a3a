"""Session affinity: ``session_id -> (worker, dp_rank)`` with a sliding TTL.

Semantics (``nvext.session_control.action``):

* ``open``: the request is routed normally, then the session is bound to the chosen worker.
* ``bind``: like ``open`` when the session is unknown; a known session routes to its worker.
* ``close``: a known session routes to its worker one last time and is then removed.
* no action, but a known ``session_id``: routes to its worker.

Every use slides the expiry forward by the session's timeout. ``expire(now)`` returns what expired,
so the caller can close the engine-side sessions too. Each session remembers its owner (the client
that opened it) so the router can bound how many one client holds (``owned_by``).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh._types import WorkerId, WorkerKey


@dataclass(slots=True)
class _Session:
    worker: WorkerKey
    timeout: float
    expires: float
    owner: str | None = None


class SessionTable:
    def __init__(self, default_timeout: float = 300.0) -> None:
        self.default_timeout = default_timeout
        self._sessions: dict[str, _Session] = {}
        self._owned: dict[str, int] = {}

    def owned_by(self, owner: str) -> int:
        """Live sessions ``owner`` opened."""
        return self._owned.get(owner, 0)

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._sessions

    def lookup(self, session_id: str, now: float) -> WorkerKey | None:
        """The bound worker of a live session (sliding its expiry), else None."""
        s = self._sessions.get(session_id)
        if s is None:
            return None
        if s.expires <= now:
            return None  # expired but not yet collected: expire() will report it
        s.expires = now + s.timeout
        return s.worker

    def bind(
        self,
        session_id: str,
        worker: WorkerKey,
        now: float,
        timeout: float | None = None,
        owner: str | None = None,
    ) -> None:
        t = self.default_timeout if timeout is None else timeout
        old = self._sessions.get(session_id)
        if old is not None:
            owner = old.owner  # a rebind keeps the session's first owner
        elif owner is not None:
            self._owned[owner] = self._owned.get(owner, 0) + 1
        self._sessions[session_id] = _Session(worker, t, now + t, owner)

    def peek(self, session_id: str) -> WorkerKey | None:
        s = self._sessions.get(session_id)
        return s.worker if s is not None else None

    def timeout_of(self, session_id: str) -> float | None:
        s = self._sessions.get(session_id)
        return s.timeout if s is not None else None

    def close(self, session_id: str) -> WorkerKey | None:
        s = self._sessions.pop(session_id, None)
        if s is None:
            return None
        self._disown(s)
        return s.worker

    def expire(self, now: float) -> list[tuple[str, WorkerKey]]:
        return self._drop([sid for sid, s in self._sessions.items() if s.expires <= now])

    def remove_worker(self, worker_id: WorkerId) -> list[tuple[str, WorkerKey]]:
        return self._drop([sid for sid, s in self._sessions.items() if s.worker[0] == worker_id])

    def _drop(self, ids: list[str]) -> list[tuple[str, WorkerKey]]:
        gone = []
        for sid in ids:
            s = self._sessions.pop(sid)
            self._disown(s)
            gone.append((sid, s.worker))
        return gone

    def _disown(self, s: _Session) -> None:
        if s.owner is not None:
            left = self._owned.get(s.owner, 0) - 1
            if left > 0:
                self._owned[s.owner] = left
            else:
                self._owned.pop(s.owner, None)
