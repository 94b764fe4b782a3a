"""End to end on a small fleet of ``kvmesh mock`` processes behind ``kvmesh router``: the latency
cost against Dynamo's on the same seeded agent workload.

Asserted: what the routing decisions did to the engines (the prefill work they reported, their
prefix hits) and what the router's timing model learned. Not asserted: wall-clock latencies.
"""

from __future__ import annotations

import aiohttp
import pytest

from kvmesh.bench import report
from kvmesh.bench.fleet import kvmesh_router, start_fleet
from kvmesh.bench.runner import LoadSpec, run_workload
from kvmesh.bench.workloads import WorkloadSpec, build
from kvmesh.router.core.wait_spread import PRIOR

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ENGINE = ["--speedup", "4", "--block-size", "16", "--num-blocks", "1024"]
SPEC = WorkloadSpec("agent-long", sessions=8, turns=4, groups=2, prefix_words=900, question_words=300,
                    max_tokens=8, seed=7)  # fmt: skip


async def _run(cost_model: str) -> tuple[dict[str, object], list[dict[str, object]], dict[str, object]]:
    front = kvmesh_router("--router-cost-model", cost_model)
    async with start_fleet(3, ENGINE, front) as fleet:
        load = LoadSpec(urls=(fleet.front_url,), concurrency=6, think_time=0.05, seed=7)
        run = await run_workload(cost_model, build(SPEC), load)
        async with aiohttp.ClientSession() as http:
            async with http.get(fleet.front_url + "/kvmesh/workers") as r:
                workers = (await r.json())["workers"]
            async with http.get(fleet.front_url + "/kvmesh/router") as r:
                described = await r.json()
    return report.summarize(run), workers, described


async def test_the_latency_cost_does_no_more_prefill_work_than_dynamos_and_learns_the_engines() -> None:
    dynamo, _, described = await _run("dynamo")
    assert described["conversations"] is None  # Dynamo's cost prices no conversations
    assert described["ttft_tail"] is None  # nor bounds any tail
    assert described["decode_pass_lag"] is None  # nor waits out decode passes
    latency, workers, described = await _run("latency")
    assert dynamo["errors"] == 0 and latency["errors"] == 0
    assert latency["requests"] == dynamo["requests"] == 32

    def uncached(s: dict[str, object]) -> int:
        return int(s["prompt_tokens"]) - int(s["cached_tokens"])  # type: ignore[call-overload]

    # the engines recomputed no more prompt tokens under the latency cost (same seeded prompts)
    assert uncached(latency) <= 1.05 * uncached(dynamo)
    assert latency["prefix_hit_ratio"] >= dynamo["prefix_hit_ratio"] - 0.02  # type: ignore[operator]
    models = [rank["timing_model"] for w in workers for rank in w["ranks"]]
    assert all(m is not None for m in models)
    # every finished request taught its worker, but those that ran in the step of the request
    # routed just before them (their TTFT was that step's, not a prefill of their own)
    steps = described["steps_joined"]
    assert isinstance(steps, dict)
    joined = round(sum(n * share for n, share in zip(steps["seen"], steps["joined_share"], strict=True)))
    assert sum(m["observations"] for m in models) + joined == 32
    # 8 sessions of 4 turns: 24 of the 32 requests were later turns of earlier ones
    conversations = described["conversations"]
    assert isinstance(conversations, dict)
    assert conversations["continued_share"] == 0.75
    assert conversations["turns_to_come"] == 3.0  # after a first turn, counted from the turns reached
    assert conversations["deepest_turn"] == 4
    # the cache is held for the turns seen, and for as many again while no fourth turn is overdue
    assert conversations["turns_to_hold"] in (3.0, 3.0 + 4.0)
    assert conversations["blocks_per_turn"] > 300 // 16  # a turn adds its ~700-token tool output
    assert conversations["live"] > 0  # the last turns, not yet overdue
    # the engines' caches hold every session: each later turn found its history where it was
    assert conversations["history_found"] > 0.95
    # every streamed first token was timed, every decision offered its best; 32 are too few for a
    # 99th percentile to bound anything
    assert described["ttft_tail"] == {"decisions": 32, "offered_p99_ms": None, "requests": 32, "p99_ms": None}
    # the decode passes' lag is learned from requests that found a worker decoding; 32 requests
    # are too few for it to be used
    lag = described["decode_pass_lag"]
    assert isinstance(lag, dict) and lag["lag_ms"] == 0.0 and 0 <= lag["requests"] < 32
    live = [rank["live_conversation_blocks"] for w in workers for rank in w["ranks"]]
    assert sum(live) > 0
    # each worker's learned stay (dispatch to finish) holds its decode (first token to finish)
    for rank in (rank for w in workers for rank in w["ranks"] if rank["timing_model"]["observations"]):
        assert rank["stay_seconds"] > rank["decode_seconds"] > 0


async def test_a_fleet_past_its_caches_teaches_the_router_how_far_its_waits_for_memory_come_out() -> None:
    """Two engines with room for about three of these requests each, six in flight: requests
    wait for KV memory, the decisions show the waits predicted, and the router learns from the
    waits the requests then had how far those predictions are off (``memory_waits`` in
    ``GET /kvmesh/router``), which is what decides when two candidates' costs are a tie."""
    front = kvmesh_router()
    engine = ["--speedup", "4", "--block-size", "16", "--num-blocks", "400"]
    async with start_fleet(2, engine, front) as fleet:
        load = LoadSpec(urls=(fleet.front_url,), concurrency=6, think_time=0.0, seed=3)
        run = await run_workload("latency", build(SPEC), load)
        async with aiohttp.ClientSession() as http:
            async with http.get(fleet.front_url + "/kvmesh/router") as r:
                waits = (await r.json())["memory_waits"]
            async with http.get(fleet.front_url + "/kvmesh/decisions?limit=64") as r:
                decisions = (await r.json())["decisions"]
    assert report.summarize(run)["errors"] == 0
    predicted = [c["memory_wait_ms"] for d in decisions for c in d["candidates"]]
    assert max(predicted) > 0.0
    assert waits["requests"] > 0
    assert waits["relative_spread"] != PRIOR  # learned from this fleet's waits
    assert waits["relative_spread"] > 0.0
