"""Pins and sessions on TensorRT-LLM: cache *retention* claims, kept within kvmesh's budget.

TensorRT-LLM exposes no way to take a reference on a cached block. What it has is per-request
cache retention (``KvCacheRetentionConfig``): a request names token ranges
(``TokenRangeRetentionConfig(token_start, token_end, priority 0-100, duration)``), and the blocks
whose first token falls in a range get that eviction priority (default 35) for that duration,
counted from when the last request using them lets go; expired blocks fall back to 35. "The latest
claim with an explicit priority sets its priority" (TensorRT-LLM's retention docs).

So a pin here is a *claim*: a one-token request (``max_tokens=1``) for the prefix's tokens, whose
retention config gives the prefix's full blocks priority :data:`PIN_PRIORITY` for the pin's TTL.
The request reuses the cached blocks, so it costs a near-empty prefill. Releasing a block early
(the pin expired or lost its budget) is another claim over the same tokens with the released
blocks' range at :data:`DEFAULT_PRIORITY`. Which blocks a prefix covers comes from the bridge's
record (:class:`.record.RankRecord`): only blocks the engine reported stored are pinned or counted.

The budget, TTLs, sessions and "a pin extends, never shortens" are kvmesh's engine-agnostic
ledger (:class:`kvmesh.worker.retention.Retention`, policy ``truncate``: a pin over the budget
keeps its longest prefix that fits). The ledger hands out one acquire per hold; this module keeps
its own count per block so a block shared by two holds is released only when both let go.

**Best-effort, and said so in /kvmesh/info and docs/trtllm.md:** a priority-100 block that no
request uses can still be evicted when the engine needs room for running requests, and offloading
it to host memory clears its duration. Retention is a strong hint, not the hard reference vLLM's
pins take. Sessions (TensorRT-LLM has none) are the router's affinity plus a retention pin of the
conversation so far, renewed after every turn.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from kvmesh.adapters.trtllm._trtllm import import_trtllm
from kvmesh.adapters.trtllm.record import RankRecord
from kvmesh.errors import ConfigError
from kvmesh.worker.retention import Retention

logger = logging.getLogger("kvmesh.adapters.trtllm")

PIN_PRIORITY = 100
"""Retention priority of pinned blocks (TensorRT-LLM's scale is 0-100, 100 highest)."""
DEFAULT_PRIORITY = 35
"""TensorRT-LLM's default retention priority, what a released block goes back to."""
PIN_BUDGET_FLAG = "--kvmesh-pin-budget"
MAX_SESSIONS = 100_000


def check_budget(value: float) -> float:
    if not (0.0 <= value <= 1.0) or math.isnan(value):
        raise ConfigError(f"{PIN_BUDGET_FLAG} must be a fraction between 0 and 1, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class Claim:
    """One retention request: the prompt tokens and the ranges (start, end, priority, seconds|None)."""

    rank: int
    token_ids: tuple[int, ...]
    ranges: tuple[tuple[int, int, int, float | None], ...]


class RankRetention:
    """Pins and sessions of one attention-DP rank, as retention claims."""

    def __init__(
        self,
        rank: int,
        record: RankRecord,
        capacity_blocks: int,
        budget_fraction: float,
        submit: Callable[[Claim], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rank = rank
        self.record = record
        self.block_size = record.block_size
        self.submit = submit
        self.clock = clock
        self.ledger: Retention[int] = Retention(
            int(capacity_blocks * budget_fraction),
            acquire=self._acquire,
            release=self._release,
            on_over_budget="truncate",
            total_blocks=capacity_blocks,
            budget_setting=PIN_BUDGET_FLAG,
            max_sessions=MAX_SESSIONS,
        )
        self._held: dict[int, int] = {}  # block -> holds containing it
        self._tokens: dict[int, tuple[int, ...]] = {}  # held block -> its tokens
        self._until: dict[int, float] = {}  # held block -> latest deadline claimed for it
        self._turns: dict[str, Any] = {}  # session -> its newest turn's result (not yet retained)

    # ------------------------------------------------------------------ pins
    def pin(self, token_ids: Sequence[int], ttl: float) -> int:
        now = self.clock()
        self.expire(now)
        blocks = self.record.cached_prefix(token_ids)
        pinned = self.ledger.pin(blocks, ttl, now)
        if pinned:
            self._claim(blocks[:pinned], now + ttl, now)
        return pinned

    # ------------------------------------------------------------------ sessions
    def open_session(self, session_id: str, timeout: float) -> bool:
        now = self.clock()
        self.expire(now)
        return self.ledger.open_session(session_id, timeout, now)

    def close_session(self, session_id: str) -> bool:
        self._turns.pop(session_id, None)
        return self.ledger.close_session(session_id)

    def note_turn(self, session_id: str, result: Any) -> None:
        """A request of an open session went to the engine: slide its deadline; its prefix is
        retained once the engine has finished (and reported) the turn."""
        if self.ledger.touch_session(session_id, self.clock()):
            self._turns[session_id] = result

    def _retain_turns(self, now: float) -> None:
        for session_id, result in list(self._turns.items()):
            if not getattr(result, "finished", False):
                continue
            del self._turns[session_id]
            timeout = self.ledger.sessions.get(session_id)
            if timeout is None:
                continue
            tokens = list(getattr(result, "prompt_token_ids", None) or [])
            outputs = getattr(result, "outputs", None) or []
            if outputs:
                tokens.extend(getattr(outputs[0], "token_ids", None) or [])
            blocks = self.record.cached_prefix(tokens)
            held = self.ledger.retain_for_session(session_id, blocks)
            if held:
                self._claim(blocks[:held], now + timeout, now)

    # ------------------------------------------------------------------ time
    def tick(self) -> float | None:
        """Retain finished session turns, expire what ran out; seconds until the next deadline."""
        now = self.clock()
        self._retain_turns(now)
        self.expire(now)
        deadline = self.ledger.next_expiry()
        return None if deadline is None else max(0.0, deadline - now)

    def expire(self, now: float) -> None:
        for session_id in self.ledger.expire(now):
            self._turns.pop(session_id, None)

    # ------------------------------------------------------------------ claims
    def _claim(self, blocks: Sequence[int], deadline: float, now: float) -> None:
        """Claim the prefix ``blocks`` (head first) at PIN_PRIORITY until the latest deadline any
        hold wants for them (a claim sets the duration of its whole range)."""
        for block in blocks:
            self._until[block] = max(self._until.get(block, deadline), deadline)
        until = max(self._until[b] for b in blocks)
        tokens = self._prefix_tokens(blocks)
        if tokens is None:
            return
        end = len(blocks) * self.block_size
        self.submit(Claim(self.rank, _with_tail(tokens), ((0, end, PIN_PRIORITY, until - now),)))

    def _acquire(self, blocks: tuple[int, ...]) -> None:
        for block in blocks:
            self._held[block] = self._held.get(block, 0) + 1
            if block not in self._tokens:
                tokens = self.record.tokens_of(block)
                self._tokens[block] = tokens if tokens is not None else ()

    def _release(self, blocks: tuple[int, ...]) -> None:
        """The ledger releases one hold's blocks tail first; the ones no other hold keeps go back
        to the default priority, in one claim over the hold's prefix."""
        head_first = blocks[::-1]
        tokens = self._prefix_tokens(head_first)
        freed: list[int] = []
        for position, block in enumerate(head_first):
            n = self._held.get(block, 0) - 1
            if n > 0:
                self._held[block] = n
                continue
            self._held.pop(block, None)
            self._tokens.pop(block, None)
            self._until.pop(block, None)
            freed.append(position)
        if not freed or tokens is None:
            return
        size = self.block_size
        ranges = tuple(
            (start * size, (stop + 1) * size, DEFAULT_PRIORITY, None) for start, stop in _runs(freed)
        )
        self.submit(Claim(self.rank, _with_tail(tokens[: (freed[-1] + 1) * size]), ranges))

    def _prefix_tokens(self, blocks: Sequence[int]) -> tuple[int, ...] | None:
        out: list[int] = []
        for block in blocks:
            tokens = self._tokens.get(block) or self.record.tokens_of(block)
            if not tokens:
                return None  # the chain is no longer known: the engine's own duration takes over
            out.extend(tokens)
        return tuple(out)


def _with_tail(tokens: tuple[int, ...]) -> tuple[int, ...]:
    """The engine never stores a prompt's last token in a block, so a claim over n full blocks
    sends one token more (its value does not matter: it lands in no claimed block)."""
    return (*tokens, tokens[-1]) if tokens else tokens


def _runs(positions: list[int]) -> list[tuple[int, int]]:
    """Sorted positions as inclusive runs: [1, 2, 3, 5] -> [(1, 3), (5, 5)]."""
    runs: list[tuple[int, int]] = []
    for p in sorted(positions):
        if runs and runs[-1][1] == p - 1:
            runs[-1] = (runs[-1][0], p)
        else:
            runs.append((p, p))
    return runs


class ClaimSubmitter:
    """Sends claims to the engine as one-token requests through its own ``generate_async``,
    in the background; keeps the tasks alive until they finish and counts the outcomes."""

    def __init__(self, generate_async: Callable[..., Any], *, dp_size: int) -> None:
        self.generate_async = generate_async
        self.dp_size = dp_size
        self.sent = 0
        self.failed = 0
        self._tasks: set[asyncio.Task[None]] = set()

    def build_kwargs(self, claim: Claim) -> dict[str, Any]:
        llmapi = import_trtllm("tensorrt_llm.llmapi")
        ranges = [
            llmapi.KvCacheRetentionConfig.TokenRangeRetentionConfig(
                start, end, priority, None if seconds is None else timedelta(seconds=max(seconds, 0.0))
            )
            for start, end, priority, seconds in claim.ranges
        ]
        kwargs: dict[str, Any] = {
            "sampling_params": llmapi.SamplingParams(max_tokens=1),
            "kv_cache_retention_config": llmapi.KvCacheRetentionConfig(ranges, DEFAULT_PRIORITY),
        }
        if self.dp_size > 1:
            scheduling = import_trtllm("tensorrt_llm.scheduling_params")
            kwargs["scheduling_params"] = scheduling.SchedulingParams(
                attention_dp_rank=claim.rank, attention_dp_relax=False
            )
        return kwargs

    def __call__(self, claim: Claim) -> None:
        kwargs = self.build_kwargs(claim)
        self.sent += 1
        task = asyncio.get_running_loop().create_task(self._run(list(claim.token_ids), kwargs))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, token_ids: list[int], kwargs: dict[str, Any]) -> None:
        try:
            result = self.generate_async(token_ids, **kwargs)
            await result.aresult()
        except Exception as e:  # a failed claim leaves the engine's previous priorities in place
            self.failed += 1
            logger.warning("kvmesh: a TensorRT-LLM retention claim failed: %s", e)

    async def drain(self) -> None:
        """Wait for every claim sent so far (tests and shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
