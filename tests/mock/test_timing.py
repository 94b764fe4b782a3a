"""Timing follows the fitted step model, and priority orders waiting requests (vLLM's polarity)."""

from __future__ import annotations

import asyncio
import itertools
import random
import statistics
import time

import httpx
import pytest

from kvmesh.mock.testing import run_mock
from kvmesh.mock.timing import decode_ms, prefill_ms

pytestmark = pytest.mark.e2e

BS = 64
NUM_BLOCKS = 1024


async def _stream_times(
    http: httpx.AsyncClient, prompt: list[int], max_tokens: int
) -> tuple[float, list[float], int]:
    """(time to first token, gaps between tokens, cached tokens) of one streamed request, in ms."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    arrivals = []
    cached = -1
    start = time.perf_counter()
    async with http.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            now = time.perf_counter()
            if '"usage":{' in line:
                cached = int(line.split('"cached_tokens":')[1].split("}")[0])
            elif line.startswith("data: {"):
                arrivals.append(now)
    gaps = [(b - a) * 1e3 for a, b in itertools.pairwise(arrivals)]
    return (arrivals[0] - start) * 1e3, gaps, cached


async def test_ttft_and_inter_token_gap_follow_the_model_and_a_cached_prefix_is_faster() -> None:
    rng = random.Random(5)
    prompt = [rng.randrange(300, 30_000) for _ in range(4000)]
    async with (
        run_mock(block_size=BS, num_blocks=NUM_BLOCKS, speedup=1) as mock,
        httpx.AsyncClient(base_url=mock.base_url) as http,
    ):
        await _stream_times(http, [1, 2, 3], 2)  # warm up the connection and the server
        ttft, gaps, cached = await _stream_times(http, prompt, 30)
        assert cached == 0
        usage = -(-4000 // BS) / NUM_BLOCKS
        model_ttft = prefill_ms(4000) + decode_ms(usage)
        model_itl = decode_ms(usage + 0.5 / NUM_BLOCKS)
        assert 0.95 * model_ttft <= ttft <= 1.3 * model_ttft + 15, (ttft, model_ttft)
        itl = statistics.median(gaps)
        assert 0.8 * model_itl <= itl <= 1.3 * model_itl + 2, (itl, model_itl)

        ttft_cached, _, cached = await _stream_times(http, prompt, 2)
        assert cached == (4000 - 1) // BS * BS
        model_cached = prefill_ms(4000 - cached) + decode_ms(usage)
        assert 0.95 * model_cached <= ttft_cached <= 1.3 * model_cached + 15, (ttft_cached, model_cached)
        assert ttft_cached < ttft - 40, (ttft_cached, ttft)


async def test_speedup_divides_step_time() -> None:
    prompt = list(range(300, 2300))
    async with (
        run_mock(block_size=BS, num_blocks=NUM_BLOCKS, speedup=4) as mock,
        httpx.AsyncClient(base_url=mock.base_url) as http,
    ):
        await _stream_times(http, [1, 2, 3], 2)
        ttft, gaps, _ = await _stream_times(http, prompt, 20)
        usage = -(-2000 // BS) / NUM_BLOCKS
        model_ttft = (prefill_ms(2000) + decode_ms(usage)) / 4
        assert 0.95 * model_ttft <= ttft <= 1.3 * model_ttft + 15, (ttft, model_ttft)
        assert statistics.median(gaps) <= 1.3 * decode_ms(usage) / 4 + 2


async def _finish_order(policy: str, priorities: list[int | None]) -> list[int]:
    """Start a long request, then queue short ones (max_num_seqs=1); return the order they finish."""
    async with (
        run_mock(
            block_size=16,
            num_blocks=256,
            max_num_seqs=1,
            speedup=1,
            scheduling_policy=policy,  # type: ignore[arg-type]
        ) as mock,
        httpx.AsyncClient(base_url=mock.base_url, timeout=30) as http,
    ):
        order: list[int] = []

        async def short(i: int, priority: int | None) -> None:
            body: dict[str, object] = {"prompt": [100 + i] * 20, "max_tokens": 2}
            if priority is not None:
                body["priority"] = priority
            r = await http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            order.append(i)

        blocker = asyncio.create_task(
            http.post("/v1/completions", json={"prompt": [7] * 20, "max_tokens": 40})
        )
        while mock.engine.scheduler.num_running == 0:
            await asyncio.sleep(0.002)
        tasks = []
        for i, p in enumerate(priorities):
            tasks.append(asyncio.create_task(short(i, p)))
            while mock.engine.scheduler.num_waiting < i + 1:  # queued in this order
                await asyncio.sleep(0.002)
        assert mock.engine.scheduler.num_running == 1  # all of them wait behind the blocker
        await asyncio.gather(blocker, *tasks)
        return order


async def test_priority_policy_starts_lower_values_first_ties_by_arrival() -> None:
    assert await _finish_order("priority", [5, -3, 0, -3, 2]) == [1, 3, 2, 4, 0]


async def test_fcfs_policy_keeps_arrival_order() -> None:
    assert await _finish_order("fcfs", [None] * 5) == [0, 1, 2, 3, 4]
