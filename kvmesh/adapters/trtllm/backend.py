"""kvmesh's worker side for one TensorRT-LLM ``LLM``: the bridge, retention and the ``/kvmesh/*`` RPCs.

:class:`TrtllmWorker` is created per ``OpenAIServer`` (by :mod:`.server`) around the server's
LLM object and started on uvicorn's event loop. It owns the event bridge (:mod:`.bridge`), one
retention ledger per attention-DP rank (:mod:`.retention`), the request-hint hook on
``generate_async`` (:mod:`.hints`) and a clock task that expires pins and retains session turns;
it answers :class:`kvmesh.worker.rpc.WorkerBackend`.

Where the numbers come from (TensorRT-LLM's ``LLM.args`` is its pydantic ``LlmArgs``):

* block size: ``args.kv_cache_config.tokens_per_block`` (32 when unset, TensorRT-LLM's default);
* DP size: ``args.tensor_parallel_size`` when ``args.enable_attention_dp``, else 1 (Dynamo reads it
  the same way);
* capacity: the GPU block count of the engine's start-up ``created`` event for the full-attention
  window, else ``args.kv_cache_config.max_tokens / block size``, else ``kvCacheStats.maxNumBlocks``
  from one ``get_stats_async`` read;
* ``priority_polarity``: ``higher_first`` when the installed ``generate_async`` takes ``priority``
  (TensorRT-LLM's newer LLM API), else ``none``, and a start-up log line says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvmesh.adapters.trtllm._trtllm import DEFAULT_BLOCK_SIZE
from kvmesh.adapters.trtllm.bridge import KvEventBridge
from kvmesh.adapters.trtllm.hints import has_priority_parameter, wrap_generate_async
from kvmesh.adapters.trtllm.retention import ClaimSubmitter, RankRetention
from kvmesh.errors import RequestError
from kvmesh.worker.advertise import reachable
from kvmesh.worker.block_state import kv_state_answer
from kvmesh.worker.retention import DEFAULT_PIN_BUDGET

logger = logging.getLogger("kvmesh.adapters.trtllm")

NO_PRIORITY_LOG = (
    "kvmesh: this TensorRT-LLM's generate_async has no request priority; "
    "nvext.agent_hints.priority only orders kvmesh's own queue"
)
PIN_SEMANTICS = "retention"
"""Pins are TensorRT-LLM cache-retention claims: best-effort under memory pressure (see .retention)."""


@dataclass(frozen=True)
class WorkerOptions:
    """The adapter's own settings (the launcher's ``--kvmesh-*`` flags)."""

    events_endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = "tcp://*:5567"
    """(Ten ports above the events': rank r binds each + r, so up to ten attention-DP ranks fit.)"""
    pin_budget: float = DEFAULT_PIN_BUDGET
    advertise_host: str | None = None
    tick_seconds: float = 0.5
    poll_max_delay: float = 0.05


def _attr(obj: Any, *path: str) -> Any:
    for name in path:
        obj = getattr(obj, name, None) if not isinstance(obj, dict) else obj.get(name)
        if obj is None:
            return None
    return obj


def block_size_of(llm: Any) -> int:
    size = _attr(llm, "args", "kv_cache_config", "tokens_per_block")
    return int(size) if size else DEFAULT_BLOCK_SIZE


def dp_size_of(llm: Any) -> int:
    if _attr(llm, "args", "enable_attention_dp"):
        return int(_attr(llm, "args", "tensor_parallel_size") or 1)
    return 1


class TrtllmWorker:
    """The WorkerBackend over one TensorRT-LLM LLM, plus the tasks that keep it current."""

    def __init__(
        self,
        llm: Any,
        *,
        model: str | None,
        options: WorkerOptions,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.llm = llm
        self.clock = clock
        self.model = model
        self.options = options
        self.block_size = block_size_of(llm)
        self.dp_size = dp_size_of(llm)
        self.engine_priority = has_priority_parameter(llm.generate_async)
        if not self.engine_priority:
            logger.warning(NO_PRIORITY_LOG)
        self.bridge = KvEventBridge(
            llm,
            block_size=self.block_size,
            dp_size=self.dp_size,
            endpoint=options.events_endpoint,
            replay_endpoint=options.replay_endpoint,
            max_delay=options.poll_max_delay,
        )
        original = wrap_generate_async(llm, pass_priority=self.engine_priority, on_session_turn=self._turn)
        self.claims = ClaimSubmitter(original, dp_size=self.dp_size)
        self._retention: dict[int, RankRetention] = {}
        self._stats_capacity: int | None = None
        self._ticker: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ life cycle
    def start(self) -> None:
        self.bridge.start()
        if self._ticker is None:
            self._ticker = asyncio.get_running_loop().create_task(
                self._tick_loop(), name="kvmesh-trtllm-tick"
            )

    async def stop(self) -> None:
        task, self._ticker = self._ticker, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.bridge.stop()

    async def _tick_loop(self) -> None:
        interval = self.options.tick_seconds
        while True:
            waits = [w for w in (r.tick() for r in self._retention.values()) if w is not None]
            await asyncio.sleep(min([interval, *[max(w, 0.01) for w in waits]]))

    # ------------------------------------------------------------------ capacity and retention
    async def capacity_blocks(self) -> int | None:
        created = self.bridge.converter.capacity_blocks
        if created:
            return min(created.values())
        max_tokens = _attr(self.llm, "args", "kv_cache_config", "max_tokens")
        if max_tokens:
            return int(max_tokens) // self.block_size
        if self._stats_capacity is None:
            self._stats_capacity = await self._capacity_from_stats()
        return self._stats_capacity

    async def _capacity_from_stats(self) -> int | None:
        try:
            async for stat in self.llm.get_stats_async(0):
                stat = json.loads(stat) if isinstance(stat, str) else stat
                blocks = _attr(stat, "kvCacheStats", "maxNumBlocks")
                if blocks:
                    return int(blocks)
        except Exception as e:  # no iteration has run yet, or stats are off
            logger.debug("kvmesh: no TensorRT-LLM iteration stats: %s", e)
        return None

    async def retention(self, rank: int) -> RankRetention:
        ledger = self._retention.get(rank)
        if ledger is None:
            capacity = await self.capacity_blocks()
            if capacity is None:
                raise RequestError(
                    "the TensorRT-LLM KV cache size is not known yet (no start-up event or stats)",
                    status=409,
                )
            ledger = RankRetention(
                rank, self.bridge.records[rank], capacity, self.options.pin_budget, self.claims, self.clock
            )
            self._retention[rank] = ledger
        return ledger

    def _turn(self, session_id: str, result: Any) -> None:
        for ledger in self._retention.values():
            ledger.note_turn(session_id, result)

    # ------------------------------------------------------------------ WorkerBackend
    async def info(self) -> dict[str, Any]:
        return {
            "backend": "trtllm",
            "model": self.model,
            "block_size": self.block_size,
            "dp_size": self.dp_size,
            "kv_events_endpoints": [self._reachable(e) for e in self.bridge.endpoints],
            "kv_replay_endpoints": [
                None if e is None else self._reachable(e) for e in self.bridge.replay_endpoints
            ],
            "max_num_batched_tokens": int(_attr(self.llm, "args", "max_num_tokens") or 8192),
            "total_kv_blocks": await self.capacity_blocks(),
            "priority_polarity": "higher_first" if self.engine_priority else "none",
            "pin_semantics": PIN_SEMANTICS,
        }

    async def kv_state(self) -> dict[str, Any]:
        return kv_state_answer(self.block_size, self.bridge.kv_state_ranks())

    async def pin_prefix(self, token_ids: list[int], ttl_seconds: float) -> int:
        total = 0
        for rank in range(self.dp_size):
            if self.bridge.records[rank].cached_prefix(token_ids):  # nothing cached: nothing to hold
                total += (await self.retention(rank)).pin(token_ids, ttl_seconds)
        return total

    async def open_session(self, session_id: str, timeout: float) -> bool:
        created = False
        for rank in range(self.dp_size):
            created = (await self.retention(rank)).open_session(session_id, timeout) or created
        return created

    async def close_session(self, session_id: str) -> bool:
        closed = False
        for ledger in self._retention.values():
            closed = ledger.close_session(session_id) or closed
        return closed

    async def reset_prefix_cache(self) -> bool:
        raise RequestError("TensorRT-LLM offers no prefix-cache reset", status=409)

    def _reachable(self, endpoint: str) -> str:
        """A bound wildcard endpoint (``tcp://*:5557``) as a peer can dial it."""
        return reachable(endpoint, self.options.advertise_host)
