"""kvmesh's worker RPCs inside vLLM's engine-core process, where the block pool lives.

vLLM's API server reaches the engine core through *utility calls*: the client sends a method name
and arguments, and ``EngineCore`` runs ``getattr(self, method)(*args)`` between scheduler steps, in
the scheduler's own thread. kvmesh's general plugin adds one method, ``kvmesh_rpc(name, payload)``,
that dispatches to an :class:`EngineRpc` created on first use. So pins and sessions touch the real
block pool with no locking and no scheduler subclass (a custom ``--scheduler-cls`` would switch
off vLLM's async scheduling).

Pins take an ordinary reference on each cached block of a prefix (``BlockPool.touch``: a cached
block with no other user leaves the free queue, so it cannot be evicted) and drop it on expiry
(``BlockPool.free_blocks``: back to the tail of the free queue, still cached). The engine-agnostic
bookkeeping (TTL, distinct-block budget, sessions) is :mod:`kvmesh.worker.retention`; a pin that
does not fit in the budget keeps the longest prefix that does (policy ``"truncate"``).

Sessions: vLLM carries a request's ``session_id`` (body field, ``X-Session-ID`` header or
``vllm_xargs``) into the engine core. The plugin wraps ``EngineCore.add_request`` to note, for an
open session, the newest request's block-hash list (vLLM's own, which grows as the answer is
generated); every ``tick`` re-pins the session's cached prefix from it and slides its deadline.
Deadlines are checked on every RPC and on ``tick``, which the API server calls periodically.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvmesh.adapters.vllm._vllm import import_vllm
from kvmesh.worker.retention import DEFAULT_PIN_BUDGET, PIN_BUDGET_ENV, Retention, pin_budget_from_env

logger = logging.getLogger("kvmesh.adapters.vllm")


MAX_SESSIONS = 100_000
"""Open sessions per engine core; one more is refused (a leak guard, not a tuning knob)."""

RPC_METHOD = "kvmesh_rpc"
"""The utility method the general plugin adds to vLLM's EngineCore."""


class EngineRpc:
    """Pins, sessions and kv_state for one engine core (one data-parallel rank)."""

    def __init__(
        self,
        kv_cache_manager: Any,
        block_hasher: Callable[[Any], list[Any]] | None,
        *,
        publisher: Any = None,
        budget_fraction: float = DEFAULT_PIN_BUDGET,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.block_pool = kv_cache_manager.block_pool
        self.block_hasher = block_hasher
        self.publisher = publisher
        self.clock = clock
        usable = self.block_pool.num_gpu_blocks - 1  # block 0 is vLLM's null block
        self.retention: Retention[int] = Retention(
            int(usable * budget_fraction),
            acquire=self._acquire,
            release=self._release,
            on_over_budget="truncate",
            total_blocks=usable,
            budget_setting=PIN_BUDGET_ENV,
            max_sessions=MAX_SESSIONS,
        )
        # session -> (the live block-hash list of its newest request, its length when last pinned)
        self._turns: dict[str, tuple[Sequence[Any], int]] = {}

    @classmethod
    def for_engine_core(cls, core: Any) -> EngineRpc:
        scheduler = core.scheduler
        return cls(
            scheduler.kv_cache_manager,
            core.request_block_hasher,
            publisher=getattr(scheduler, "kv_event_publisher", None),
            budget_fraction=pin_budget_from_env(),
        )

    # ------------------------------------------------------------------ dispatch
    def call(self, name: str, payload: dict[str, Any]) -> dict[str, Any]:
        self._expire()
        if name == "pin_prefix":
            return {"blocks_pinned": self.pin_prefix(payload["token_ids"], float(payload["ttl_seconds"]))}
        if name == "open_session":
            return {"created": self.open_session(payload["session_id"], float(payload["timeout"]))}
        if name == "close_session":
            return {"closed": self.close_session(payload["session_id"])}
        if name == "kv_state":
            return self.kv_state()
        if name == "tick":
            return self.tick()
        if name == "stats":
            return self.stats()
        raise ValueError(f"unknown kvmesh engine RPC {name!r}")

    # ------------------------------------------------------------------ pins
    def pin_prefix(self, token_ids: list[int], ttl_seconds: float) -> int:
        """Hold the cached blocks of ``token_ids``' longest cached prefix for ``ttl_seconds``;
        returns how many blocks are pinned (fewer when the budget runs out)."""
        if self.block_hasher is None:
            return 0  # prefix caching is off: nothing is ever cached
        blocks = self._cached_block_ids(self._hashes_of(token_ids))
        return self.retention.pin(blocks, ttl_seconds, self.clock())

    # ------------------------------------------------------------------ sessions
    def open_session(self, session_id: str, timeout: float) -> bool:
        return self.retention.open_session(session_id, timeout, self.clock())

    def close_session(self, session_id: str) -> bool:
        self._turns.pop(session_id, None)
        return self.retention.close_session(session_id)

    def note_request(self, request: Any) -> None:
        """Called for every request the engine core admits; remembers an open session's newest
        turn and restarts the session's idle timeout."""
        session_id = getattr(request, "session_id", None)
        if session_id is None or not self.retention.touch_session(session_id, self.clock()):
            return
        self._turns[session_id] = (request.block_hashes, -1)

    def _retain_turns(self) -> None:
        retention = self.retention
        for session_id, (hashes, pinned_len) in list(self._turns.items()):
            if len(hashes) == pinned_len:
                continue  # no new full block since the last pin
            if session_id not in retention.sessions:
                del self._turns[session_id]
                continue
            retention.retain_for_session(session_id, self._cached_block_ids(list(hashes)))
            self._turns[session_id] = (hashes, len(hashes))

    # ------------------------------------------------------------------ state and time
    def kv_state(self) -> dict[str, Any]:
        snapshot = getattr(self.publisher, "snapshot", None)
        if snapshot is None:
            return {"error": "the engine's KV events are not published by kvmesh's publisher"}
        return snapshot()  # type: ignore[no-any-return]

    def tick(self) -> dict[str, Any]:
        """Pin new session turns and expire what ran out; says when the next deadline is."""
        self._retain_turns()
        self._expire()
        deadline = self.retention.next_expiry()
        return {"next_expiry_in": None if deadline is None else max(0.0, deadline - self.clock())}

    def stats(self) -> dict[str, Any]:
        retention = self.retention
        return {
            "held_blocks": retention.num_retained,
            "budget_blocks": retention.budget_blocks,
            "holds": retention.num_holds,
            "sessions": len(retention.sessions),
        }

    def _expire(self) -> None:
        for session_id in self.retention.expire(self.clock()):
            self._turns.pop(session_id, None)

    # ------------------------------------------------------------------ the block pool
    def _hashes_of(self, token_ids: list[int]) -> list[Any]:
        """vLLM's own block hashes for a prompt: a throwaway Request run through the engine's hasher."""
        import_vllm()
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        request = Request(
            request_id="kvmesh-pin",
            prompt_token_ids=list(token_ids),
            sampling_params=SamplingParams(max_tokens=1),
            pooling_params=None,
            block_hasher=self.block_hasher,
        )
        return list(request.block_hashes)

    def _cached_block_ids(self, block_hashes: list[Any]) -> list[int]:
        """Ids of the cached blocks of the longest cached prefix, position by position."""
        if not block_hashes:
            return []
        max_len = len(block_hashes) * self.block_pool.hash_block_size
        per_group, _, _ = self.kv_cache_manager.coordinator.find_longest_cache_hit(block_hashes, max_len)
        ids: list[int] = []
        for position in range(max((len(g) for g in per_group), default=0)):
            for group in per_group:
                if position < len(group) and not group[position].is_null:
                    ids.append(group[position].block_id)
        return ids

    def _acquire(self, block_ids: Sequence[int]) -> None:
        pool = self.block_pool
        pool.touch([pool.blocks[i] for i in block_ids])

    def _release(self, block_ids: Sequence[int]) -> None:
        # The ledger hands them tail first: freed blocks are evicted in that order.
        pool = self.block_pool
        pool.free_blocks([pool.blocks[i] for i in block_ids])


def kvmesh_rpc(self: Any, name: str, payload: dict[str, Any]) -> dict[str, Any]:
    """``EngineCore.kvmesh_rpc``: the utility method the general plugin installs."""
    rpc: EngineRpc | None = self.__dict__.get("_kvmesh_rpc")
    if rpc is None:
        rpc = self._kvmesh_rpc = EngineRpc.for_engine_core(self)
    return rpc.call(name, payload)


def wrap_add_request(original: Callable[..., Any]) -> Callable[..., Any]:
    """``EngineCore.add_request`` that also shows each admitted request to kvmesh's sessions."""

    def add_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, request, *args, **kwargs)
        rpc = self.__dict__.get("_kvmesh_rpc")
        if rpc is not None and request.session_id is not None:
            try:
                rpc.note_request(request)
            except Exception:  # never let session bookkeeping fail a request
                logger.exception("kvmesh: could not note session turn")
        return result

    add_request.__kvmesh_wrapped__ = original  # type: ignore[attr-defined]
    add_request.__name__ = original.__name__
    add_request.__doc__ = original.__doc__
    return add_request
