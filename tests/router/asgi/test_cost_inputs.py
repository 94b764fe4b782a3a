"""What a request or the admin API can set on the cost, over HTTP: a value the cost cannot price is
a 400 naming it, and a client's weighting of the cost never reaches what every client shares (the
predicted TTFT's metrics and error, the tail bound)."""

from __future__ import annotations

from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tests.router.asgi.test_agent_features import mock_fleet
from tests.router.fleet import chat

WEIGHT = "nvext.agent_hints.kv_overlap_score_weight"


async def _families(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(url + "/metrics") as r:
        return {f.name: f for f in text_string_to_metric_families(await r.text())}


def _sum(family: Any, suffix: str) -> float:
    return sum(s.value for s in family.samples if s.name.endswith(suffix))


async def _stream(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> int:
    async with http.post(url + "/v1/chat/completions", json={**body, "stream": True}) as r:
        await r.read()
        return r.status


async def test_a_prefill_weight_too_large_to_price_is_a_400_naming_it() -> None:
    async with mock_fleet(2) as (front, mocks, _), aiohttp.ClientSession() as http:
        model = mocks[0].config.model
        for weight in (1e308, 1e7):
            body = chat(
                "weigh this prompt", model=model, nvext={"agent_hints": {"kv_overlap_score_weight": weight}}
            )
            async with http.post(front.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 400, await r.text()
                doc = await r.json()
            assert doc["error"]["param"] == WEIGHT and "1000000" in doc["error"]["message"]
        body = chat("weigh this prompt", model=model, nvext={"agent_hints": {"kv_overlap_score_weight": 1e6}})
        assert await _stream(http, front.url, body) == 200  # the largest taken is priced


async def test_a_request_s_prefill_weight_tilts_its_cost_not_the_predicted_time() -> None:
    async with mock_fleet(2) as (front, mocks, _), aiohttp.ClientSession() as http:
        model = mocks[0].config.model
        before = await _families(http, front.url)
        for i in range(6):
            hints = {"agent_hints": {"kv_overlap_score_weight": 1000.0}}
            body = chat(f"question {i} " + "about the weighted cost " * 40, model=model, nvext=hints)
            assert await _stream(http, front.url, body) == 200
        after = await _families(http, front.url)
        async with http.get(front.url + "/kvmesh/router") as r:
            tail = (await r.json())["ttft_tail"]
    predicted = _sum(after["kvmesh_ttft_predicted_seconds"], "_sum") - _sum(
        before["kvmesh_ttft_predicted_seconds"], "_sum"
    )
    observed = _sum(after["kvmesh_ttft_observed_seconds"], "_sum") - _sum(
        before["kvmesh_ttft_observed_seconds"], "_sum"
    )
    assert observed > 0.0
    # weighted 1000x, the predictions summed to tens of seconds for answers in milliseconds
    assert predicted < 20 * observed + 0.5, (predicted, observed)
    offered = tail["offered_p99_ms"] if tail else None
    assert offered is None or offered < 5_000.0, tail


async def test_the_prediction_ratio_counts_under_predictions_in_buckets_of_their_own() -> None:
    async with mock_fleet(1) as (front, mocks, _), aiohttp.ClientSession() as http:
        model = mocks[0].config.model
        assert await _stream(http, front.url, chat("a request to predict", model=model)) == 200
        families = await _families(http, front.url)
    ratio = {s.labels["le"] for s in families["kvmesh_ttft_prediction_ratio"].samples if "le" in s.labels}
    assert {"0.25", "1.0", "2.0", "4.0", "+Inf"} <= ratio
    hit = {s.labels["le"] for s in families["kvmesh_kv_hit_rate"].samples if "le" in s.labels}
    assert {"0.0", "0.5", "1.0", "+Inf"} == hit & {"0.0", "0.5", "1.0", "+Inf", "2.0"}


async def test_busy_threshold_refuses_what_the_flag_refuses() -> None:
    async with mock_fleet(1) as (front, _, _), aiohttp.ClientSession() as http:
        url = front.url + "/busy_threshold"
        async with http.post(url, json={"active_prefill_tokens_threshold": 1.5}) as r:
            assert r.status == 400
            assert (await r.json())["error"]["param"] == "active_prefill_tokens_threshold"
        async with http.post(url, json={"active_prefill_tokens_threshold": 2.0}) as r:
            assert r.status == 200 and (await r.json())["active_prefill_tokens_threshold"] == 2
        raw = b'{"active_decode_blocks_threshold": 1e309}'
        async with http.post(url, data=raw, headers={"content-type": "application/json"}) as r:
            assert r.status == 400
            assert "out of range" in (await r.json())["error"]["message"].lower()
