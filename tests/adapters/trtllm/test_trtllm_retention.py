"""Pins, sessions and priority on the fake engine (kvmesh/adapters/trtllm/{retention,backend,hints}.py):
a pin becomes a one-token request with the right retention ranges, priorities and durations."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from datetime import timedelta
from types import ModuleType
from typing import Any

import pytest

from kvmesh.adapters.trtllm.backend import NO_PRIORITY_LOG, TrtllmWorker, WorkerOptions
from kvmesh.adapters.trtllm.hints import PRIORITY, SESSION, engine_priority
from kvmesh.adapters.trtllm.retention import DEFAULT_PRIORITY, PIN_PRIORITY

B = 4
P1 = list(range(1, 14))  # 13 tokens: 3 full blocks stored (the last token never is)
P2 = [*range(1, 9), 70, 71, 72, 73, 74]  # shares P1's first 2 blocks


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


OPTIONS = WorkerOptions(events_endpoint="tcp://127.0.0.1:0", replay_endpoint=None, pin_budget=0.5)


@pytest.fixture
async def setup(
    fake_trtllm: ModuleType, request: pytest.FixtureRequest
) -> AsyncIterator[tuple[Any, TrtllmWorker, Clock]]:
    from tensorrt_llm.llmapi import LLM, LLMWithPriority

    kwargs = dict(getattr(request, "param", {}))
    cls = LLMWithPriority if kwargs.pop("priority", False) else LLM
    llm = cls(
        kv_cache_config={"tokens_per_block": B, "event_buffer_max_size": 4096}, capacity_blocks=16, **kwargs
    )
    clock = Clock()
    worker = TrtllmWorker(llm, model="m", options=OPTIONS, clock=clock)
    yield llm, worker, clock
    await worker.stop()


def ranges(call: dict[str, Any]) -> list[tuple[int, int | None, int, timedelta | None]]:
    config = call["kv_cache_retention_config"]
    assert config.decode_retention_priority == DEFAULT_PRIORITY
    return [
        (r.token_start, r.token_end, r.priority, r.duration_ms) for r in config.token_range_retention_configs
    ]


async def warm(llm: Any, worker: TrtllmWorker, *prompts: list[int]) -> None:
    for prompt in prompts:
        llm.generate_async(prompt)
    await worker.bridge.poll_once()


def priorities(llm: Any, rank: int = 0) -> list[int]:
    cache = llm.caches[rank]
    return sorted(b.priority for b in cache.blocks.values() if len(b.tokens) == B)


async def test_a_pin_claims_its_cached_blocks_at_high_priority_for_the_ttl(setup: Any) -> None:
    llm, worker, clock = setup
    await warm(llm, worker, P1)
    assert await worker.pin_prefix(P1, 60.0) == 3
    await worker.claims.drain()
    claim = llm.calls[-1]
    assert claim["prompt"] == [*P1[:12], P1[11]]  # 3 blocks + one token that lands in none
    assert claim["sampling_params"].max_tokens == 1
    assert ranges(claim) == [(0, 12, PIN_PRIORITY, timedelta(seconds=60))]
    assert claim["scheduling_params"] is None
    assert priorities(llm) == [100, 100, 100]

    clock.now += 61
    (await worker.retention(0)).tick()
    await worker.claims.drain()
    release = llm.calls[-1]
    assert release["prompt"] == [*P1[:12], P1[11]]
    assert ranges(release) == [(0, 12, DEFAULT_PRIORITY, None)]
    assert priorities(llm) == [35, 35, 35]


async def test_only_blocks_no_other_pin_holds_are_released(setup: Any) -> None:
    llm, worker, clock = setup
    await warm(llm, worker, P1, P2)
    assert await worker.pin_prefix(P1, 100.0) == 3
    assert await worker.pin_prefix(P2, 10.0) == 3
    await worker.claims.drain()
    # The second claim's whole range lasts as long as the longest pin over any of its blocks.
    assert ranges(llm.calls[-1]) == [(0, 12, PIN_PRIORITY, timedelta(seconds=100))]
    clock.now += 11
    (await worker.retention(0)).tick()
    await worker.claims.drain()
    release = llm.calls[-1]
    assert release["prompt"] == [*P2[:12], P2[11]]
    assert ranges(release) == [(8, 12, DEFAULT_PRIORITY, None)]  # P2's own third block only
    assert priorities(llm) == [35, 100, 100, 100]


async def test_pins_stay_within_the_budget(setup: Any) -> None:
    llm, worker, _ = setup
    await warm(llm, worker, P1, P2, [9] * 21)
    ledger = await worker.retention(0)
    assert ledger.ledger.budget_blocks == 8  # half of the 16-block cache (created event)
    assert await worker.pin_prefix([9] * 21, 30.0) == 5
    assert await worker.pin_prefix(P1, 30.0) == 3  # 8 blocks: the budget is full
    assert await worker.pin_prefix(P2, 30.0) == 2  # its own third block does not fit
    await worker.claims.drain()
    assert ranges(llm.calls[-1]) == [(0, 8, PIN_PRIORITY, timedelta(seconds=30))]
    assert ledger.ledger.num_retained == 8


async def test_a_pin_of_nothing_cached_sends_nothing(setup: Any) -> None:
    llm, worker, _ = setup
    assert await worker.pin_prefix([4] * 20, 30.0) == 0
    await worker.claims.drain()
    assert llm.calls == []


async def test_a_session_retains_its_conversation_after_each_turn(setup: Any) -> None:
    llm, worker, _clock = setup
    await warm(llm, worker)  # the created event: capacity known
    assert await worker.open_session("s1", 120.0) is True
    token = SESSION.set("s1")
    try:
        llm.generate_async(P1)  # a turn through trtllm-serve's handler (the wrapped method)
    finally:
        SESSION.reset(token)
    await worker.bridge.poll_once()
    (await worker.retention(0)).tick()
    await worker.claims.drain()
    assert ranges(llm.calls[-1]) == [(0, 12, PIN_PRIORITY, timedelta(seconds=120))]
    assert await worker.close_session("s1") is True
    await worker.claims.drain()
    assert ranges(llm.calls[-1]) == [(0, 12, DEFAULT_PRIORITY, None)]


@pytest.mark.parametrize("setup", [{"enable_attention_dp": True, "tensor_parallel_size": 2}], indirect=True)
async def test_claims_target_the_rank_that_holds_the_blocks(setup: Any) -> None:
    llm, worker, _ = setup
    await warm(llm, worker, P1, [5] * 9)  # the fake puts them on ranks 0 and 1
    assert await worker.pin_prefix([5] * 9, 30.0) == 2
    await worker.claims.drain()
    scheduling = llm.calls[-1]["scheduling_params"]
    assert (scheduling.attention_dp_rank, scheduling.attention_dp_relax) == (1, False)


async def test_info_without_engine_priority(setup: Any, caplog: pytest.LogCaptureFixture) -> None:
    llm, worker, _ = setup
    await warm(llm, worker)
    info = await worker.info()
    assert info["backend"] == "trtllm"
    assert info["block_size"] == B and info["dp_size"] == 1 and info["total_kv_blocks"] == 16
    assert info["priority_polarity"] == "none"
    assert info["pin_semantics"] == "retention"
    with caplog.at_level(logging.WARNING, logger="kvmesh.adapters.trtllm"):
        other = TrtllmWorker(type(llm)(), model="m", options=OPTIONS)
    await other.stop()
    assert NO_PRIORITY_LOG in caplog.messages


@pytest.mark.parametrize("setup", [{"priority": True}], indirect=True)
async def test_priority_reaches_a_generate_async_that_has_it(setup: Any) -> None:
    llm, worker, _ = setup
    assert (await worker.info())["priority_polarity"] == "higher_first"
    token = PRIORITY.set(3.0)
    try:
        llm.generate_async([1, 2, 3])
    finally:
        PRIORITY.reset(token)
    llm.generate_async([1, 2, 3])
    assert [c["priority"] for c in llm.calls] == [engine_priority(3.0), 0.5]


def test_the_priority_scale_keeps_order_and_centres_on_the_engine_default() -> None:
    values = [-1e12, -100, -1, -0.5, 0, 0.5, 1, 7, 100, 1e6, 1e12]
    mapped = [engine_priority(v) for v in values]
    assert mapped == sorted(mapped) and len(set(mapped)) == len(mapped)
    assert engine_priority(0) == 0.5
    assert all(0 < m < 1 for m in mapped)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
async def test_the_priority_the_router_wrote_reaches_the_engine_beside_the_body(path: str) -> None:
    """The router writes ``priority`` into the body for a ``higher_first`` worker; trtllm-serve's
    handlers take no such field, so the hints middleware moves it into the request's context."""
    from kvmesh.adapters.trtllm.hints import RequestHintsMiddleware

    seen: dict[str, Any] = {}

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen["body"] = json.loads((await receive())["body"])
        seen["priority"] = PRIORITY.get()

    body = json.dumps({"model": "m", "input": "hi", "priority": 3}).encode()
    messages = iter([{"type": "http.request", "body": body, "more_body": False}])

    async def receive() -> dict[str, Any]:
        return next(messages)

    scope = {"type": "http", "method": "POST", "path": path, "root_path": "", "headers": []}
    await RequestHintsMiddleware(app)(scope, receive, None)
    assert seen == {"body": {"model": "m", "input": "hi"}, "priority": 3.0}
