"""Counts of prompts sent before they were tokenized, kept by a key until something needs them.

A prompt routed before its tokens were known (``DeferredPrompt``) is tokenized and counted once
sent, and that can wait: until then the router counts its estimated length, and only a request
that may share its blocks needs them counted first. :class:`PendingCounts` keeps each such count by
the key such a request is recognised by (its messages' fingerprint, or its first block's hash),
runs it when one arrives (:meth:`settle`), and otherwise when its owner does.
"""

from __future__ import annotations

from collections.abc import Callable


class PendingCounts:
    """Deferred counts by key: at most one a key, each run once."""

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending: dict[int, Callable[[], None]] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def defer(self, key: int, count: Callable[[], None]) -> None:
        """Keep ``count`` under ``key`` (one already kept there runs first)."""
        self.settle(key)
        self._pending[key] = count

    def settle(self, key: int, count: Callable[[], None] | None = None) -> None:
        """Run the count kept under ``key``, if it has not run yet; given ``count``, only if that is
        the one kept there (its owner's timer or first token must not run another request's)."""
        kept = self._pending.get(key)
        if kept is None or (count is not None and kept is not count):
            return
        del self._pending[key]
        kept()
