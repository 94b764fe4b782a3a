"""``pin_prefix`` inside SGLang's scheduler: hold a cached prefix in the radix cache for a TTL.

SGLang 0.5.23 has no pin API; its radix caches (``RadixCache``, the default ``UnifiedRadixCache``)
protect a path from eviction while it carries a lock reference (``inc_lock_ref(node)`` locks the
node and every ancestor; ``dec_lock_ref(node, receipt)`` releases). A running request holds its
prefix the same way. A pin here is one such lock on the node that ends the pinned prefix:
``match_prefix`` splits a node where a match ends inside it, so the lock covers exactly the
pinned pages, and later splits copy the lock count to the new parent, so the release stays right.

The engine-agnostic bookkeeping (deadlines, distinct-page budget, longest-fitting-prefix policy)
is :class:`kvmesh.worker.retention.Retention`. Its "blocks" are pages, named by the KV slot of
their first token (stable for as long as the page is cached, shared by every prefix through it).
``forget_all`` is for a tree reset: SGLang resets the tree whatever is locked (``/flush_cache``,
and a disaggregation role switch, which calls ``tree_cache.reset()`` without ``flush_cache``), so
the old nodes are gone and must not be released into the new tree. Every entry point compares the
tree's root handle (``root_node_handle()``: the root node of ``RadixCache``, the root's NodeId in
``UnifiedRadixCache``, never re-minted by either tree core) with the one the pins were taken under,
so a reset by any path drops the pins before anything is released.

Runs in the scheduler's thread only (the radix cache is not thread-safe): see :mod:`.scheduler_hooks`.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable, Sequence
from typing import Any

from kvmesh.worker.retention import DEFAULT_PIN_BUDGET, PIN_BUDGET_ENV, Retention


class RadixPins:
    """Pins of one scheduler's radix cache (one DP rank)."""

    def __init__(
        self,
        tree_cache: Any,
        *,
        page_size: int,
        total_tokens: int,
        budget_fraction: float = DEFAULT_PIN_BUDGET,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tree_cache = tree_cache
        self.page_size = max(1, page_size)
        self.clock = clock
        self.total_pages = total_tokens // self.page_size
        self.budget_pages = int(self.total_pages * budget_fraction)
        self.retention: Retention[int] = self._new_ledger()
        # last page of a held prefix -> the locks taken for it (node, receipt), newest last
        self._locks: dict[int, list[tuple[Any, Any]]] = {}
        self._pending: tuple[Sequence[int], str | None] = ((), None)
        self._root = tree_cache.root_node_handle()

    def _new_ledger(self) -> Retention[int]:
        return Retention(
            self.budget_pages,
            acquire=self._acquire,
            release=self._release,
            on_over_budget="truncate",
            total_blocks=self.total_pages,
            budget_setting=PIN_BUDGET_ENV,
        )

    # ------------------------------------------------------------------ API
    def pin(self, token_ids: Sequence[int], ttl_seconds: float, extra_key: str | None = None) -> int:
        """Lock the cached pages of ``token_ids``' longest cached prefix until ``now + ttl``
        (never shortening an earlier pin of the same prefix); returns how many pages are pinned,
        fewer when the budget runs out."""
        self.expire()
        node, length = self._match(token_ids, extra_key)
        pages = self._pages(node, length)
        self._pending = (token_ids, extra_key)
        try:
            return self.retention.pin(pages, ttl_seconds, self.clock())
        finally:
            self._pending = ((), None)

    def expire(self) -> None:
        self._notice_reset()
        self.retention.expire(self.clock())

    def next_expiry_in(self) -> float | None:
        self._notice_reset()
        deadline = self.retention.next_expiry()
        return None if deadline is None else max(0.0, deadline - self.clock())

    def forget_all(self) -> None:
        """The tree was reset (``/flush_cache``): drop every pin without touching the new tree."""
        self._locks.clear()
        self.retention = self._new_ledger()
        self._root = self.tree_cache.root_node_handle()

    def _notice_reset(self) -> None:
        root = self.tree_cache.root_node_handle()
        if root is not self._root and root != self._root:
            self.forget_all()

    def stats(self) -> dict[str, Any]:
        self._notice_reset()
        return {
            "pinned_pages": self.retention.num_retained,
            "budget_pages": self.budget_pages,
            "pins": self.retention.num_holds,
            "protected_tokens": int(self.tree_cache.protected_size()),
        }

    # ------------------------------------------------------------------ the radix cache
    def _match(self, token_ids: Sequence[int], extra_key: str | None) -> tuple[Any, int]:
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        key = RadixKey(array("q", token_ids), extra_key)
        result = self.tree_cache.match_prefix(MatchPrefixParams(key=key))
        return result.last_device_node, int(result.device_prefix_len)

    def _pages(self, node: Any, length: int) -> list[int]:
        if length == 0:
            return []
        slots = self.tree_cache.path_device_indices(node)
        return [int(s) for s in slots[: length : self.page_size].tolist()]

    def _acquire(self, pages: tuple[int, ...]) -> None:
        tokens, extra_key = self._pending
        want = len(pages) * self.page_size
        node, length = self._match(list(tokens[:want]), extra_key)
        if length != want:  # the ledger only hands over pages it was just given: a bug if not
            raise RuntimeError(f"kvmesh pin: matched {length} tokens, expected {want}")
        receipt = self.tree_cache.inc_lock_ref(node)
        self._locks.setdefault(pages[-1], []).append((node, receipt))

    def _release(self, pages_tail_first: tuple[int, ...]) -> None:
        held = self._locks.get(pages_tail_first[0])
        if not held:
            return
        node, receipt = held.pop()
        if not held:
            del self._locks[pages_tail_first[0]]
        to_params = getattr(receipt, "to_dec_params", None)
        if to_params is not None:
            self.tree_cache.dec_lock_ref(node, to_params())
        else:
            self.tree_cache.dec_lock_ref(node)
