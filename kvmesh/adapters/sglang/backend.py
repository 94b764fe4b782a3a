"""kvmesh's worker RPCs (:mod:`kvmesh.worker.rpc`) over a running SGLang server.

* ``info`` from SGLang's ``ServerArgs`` and scheduler info: page size (the block size of its KV
  events), DP size, per-rank event endpoints, capacity, priority polarity;
* ``kv_state`` from the in-process event follower (:mod:`.follower`);
* ``pin_prefix`` through the control channel to every scheduler (:mod:`.control`, :mod:`.pins`);
* ``session_control`` onto SGLang's native sessions (``TokenizerManager.open_session`` /
  ``close_session``); SGLang refuses an id that is open already, which kvmesh reports as
  ``created: false``;
* ``reset_prefix_cache`` as SGLang's ``/flush_cache`` (which also drops the pins).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from kvmesh.adapters.sglang import control
from kvmesh.adapters.sglang.follower import KvStateFollower
from kvmesh.errors import RequestError

logger = logging.getLogger("kvmesh.adapters.sglang")

SESSION_CAPACITY = 1 << 24
"""``capacity_of_str_len`` of a session SGLang opens for kvmesh (a bound SGLang requires)."""

PRIORITY_WARNING = (
    "kvmesh: SGLang runs without --enable-priority-scheduling, so nvext.agent_hints.priority only "
    "orders kvmesh's own queue; SGLang serves requests first come, first served"
)


def priority_polarity(server_args: Any) -> str:
    """How SGLang orders priorities: ``higher_first`` by default, ``lower_first`` with
    ``--schedule-low-priority-values-first``, ``none`` without priority scheduling."""
    if not getattr(server_args, "enable_priority_scheduling", False):
        return "none"
    return (
        "lower_first" if getattr(server_args, "schedule_low_priority_values_first", False) else "higher_first"
    )


class SglangWorkerBackend:
    """kvmesh's :class:`~kvmesh.worker.rpc.WorkerBackend` inside SGLang's HTTP server process."""

    def __init__(
        self,
        server_args: Any,
        *,
        events: dict[str, Any] | None,
        control_base: str | None,
        tokenizer_manager: Any = None,
        scheduler_info: dict[str, Any] | None = None,
        follower: KvStateFollower | None = None,
    ) -> None:
        self.server_args = server_args
        self.events = events  # {"endpoints": [...], "replay_endpoints": [...], "topic": str}
        self.control_base = control_base
        self.tokenizer_manager = tokenizer_manager
        self.scheduler_info = scheduler_info or {}
        self.follower = follower
        self._open_sessions: set[str] = set()

    @property
    def dp_size(self) -> int:
        return int(getattr(self.server_args, "dp_size", 1) or 1)

    @property
    def page_size(self) -> int:
        return int(getattr(self.server_args, "page_size", None) or 1)

    def _tm(self) -> Any:
        if self.tokenizer_manager is None:
            raise RequestError("SGLang's tokenizer manager is not ready", status=503)
        return self.tokenizer_manager

    # ---------------------------------------------------------------- WorkerBackend
    def info(self) -> dict[str, Any]:
        args = self.server_args
        names = getattr(args, "served_model_name", None)
        model = names if isinstance(names, str) and names else getattr(args, "model_path", None)
        total_tokens = int(self.scheduler_info.get("max_total_num_tokens") or 0)
        batched = getattr(args, "chunked_prefill_size", None) or getattr(args, "max_prefill_tokens", None)
        events = self.events or {}
        return {
            "backend": "sglang",
            "model": model,
            "block_size": self.page_size,
            "dp_size": self.dp_size,
            "kv_events_endpoints": list(events.get("endpoints", [])),
            "kv_replay_endpoints": list(events.get("replay_endpoints", [])),
            "max_num_batched_tokens": int(batched) if batched and int(batched) > 0 else None,
            "total_kv_blocks": total_tokens // self.page_size,
            "priority_polarity": priority_polarity(args),
        }

    def kv_state(self) -> dict[str, Any]:
        if self.follower is None:
            raise RequestError(
                "kv_state needs SGLang's KV events: start it with --kv-events-config (kvmesh's "
                "launcher adds one when none is given)",
                status=409,
            )
        return self.follower.answer()

    async def _each_rank(self, request: dict[str, Any]) -> list[dict[str, Any]]:
        if not self.control_base:
            raise RequestError(
                "pins need SGLang launched by kvmesh (python -m kvmesh.adapters.sglang)", status=409
            )
        calls = [
            control.call(control.control_endpoint(self.control_base, rank), request)
            for rank in range(self.dp_size)
        ]
        return list(await asyncio.gather(*calls))

    async def pin_prefix(self, token_ids: list[int], ttl_seconds: float) -> int:
        answers = await self._each_rank(
            {"op": "pin_prefix", "token_ids": token_ids, "ttl_seconds": ttl_seconds}
        )
        return sum(int(a["blocks_pinned"]) for a in answers)

    async def open_session(self, session_id: str, timeout: float) -> bool:
        from sglang.srt.managers.io_struct import OpenSessionReqInput

        opened = await self._tm().open_session(
            OpenSessionReqInput(capacity_of_str_len=SESSION_CAPACITY, session_id=session_id, timeout=timeout)
        )
        if opened is None:
            return False  # SGLang refuses an id that is still open: it stays open as it was
        self._open_sessions.add(session_id)
        return True

    async def close_session(self, session_id: str) -> bool:
        from sglang.srt.managers.io_struct import CloseSessionReqInput

        await self._tm().close_session(CloseSessionReqInput(session_id=session_id))
        if session_id in self._open_sessions:
            self._open_sessions.discard(session_id)
            return True
        return False

    async def reset_prefix_cache(self) -> bool:
        result = await self._tm().flush_cache()
        return bool(result.success)
