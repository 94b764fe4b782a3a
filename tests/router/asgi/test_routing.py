"""The standalone router in front of real loopback engines: routing, streaming, failures, errors."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import aiohttp
import pytest

from kvmesh.router.core.config import RouterConfig
from tests.router.fleet import chat, fleet
from tests.router.servers import wait_until

LONG = "The quick brown fox jumps over the lazy dog. " * 40  # ~ 40 blocks of 16 builtin tokens


async def _post(http: aiohttp.ClientSession, url: str, body: Any, **kw: Any) -> tuple[int, Any, Any]:
    async with http.post(url + "/v1/chat/completions", json=body, **kw) as r:
        data = await r.json(content_type=None)
        return r.status, data, r.headers


async def test_requests_sharing_a_prefix_land_on_the_same_worker(http: aiohttp.ClientSession) -> None:
    async with fleet(3) as (front, _, engines):
        workers = set()
        for i in range(6):
            body = chat(LONG + f" question {i}", nvext={"extra_fields": ["worker_id"]})
            status, data, headers = await _post(http, front.url, body)
            assert status == 200, data
            assert data["nvext"]["worker_id"]["decode_worker_id"] == headers["x-kvmesh-worker-id"]
            workers.add(data["nvext"]["worker_id"]["decode_worker_id"])
        assert len(workers) == 1
        assert workers <= {e.url for e in engines}


async def test_load_spreads_under_concurrency(http: aiohttp.ClientSession) -> None:
    # Each answer streams for about a second, so all 12 requests are in flight together even on a
    # loaded machine; with shorter answers they can run one after another on an idle fleet, where
    # the tie-break is random and a fair share is not guaranteed.
    async with fleet(3, engine_kwargs={"chunks": 5, "gap": 0.25}) as (front, states, _):

        async def one(i: int) -> str:
            body = chat(
                f"unrelated prompt number {i} " * 20, stream=True, nvext={"extra_fields": ["worker_id"]}
            )
            async with http.post(front.url + "/v1/chat/completions", json=body) as r:
                text = await r.text()
                assert r.status == 200, text
            return text

        await asyncio.gather(*(one(i) for i in range(12)))
        served = [len(s.received) for s in states]
        assert sum(served) == 12
        assert min(served) >= 2, served  # every worker took a share


async def test_sse_chunks_reach_the_client_as_they_are_produced(http: aiohttp.ClientSession) -> None:
    async with fleet(1, engine_kwargs={"chunks": 4, "gap": 0.25}) as (front, states, _):
        arrivals = []
        body = chat("stream me", stream=True, nvext={"extra_fields": ["worker_id", "timing"]})
        async with http.post(front.url + "/v1/chat/completions", json=body) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            buffer = b""
            async for chunk in r.content.iter_any():
                buffer += chunk
                if b"content" in chunk:
                    arrivals.append(time.perf_counter())
        produced = states[0].chunk_times
        assert len(produced) == 4
        # Each chunk arrives well before the next one is produced: nothing is buffered.
        assert len(arrivals) >= 4
        for made, got in zip(produced[:3], arrivals[:3], strict=True):
            assert got - made < 0.15
        assert arrivals[3] - arrivals[0] > 0.6
        # nvext rides in one extra data event just before [DONE]
        events = [e for e in buffer.split(b"\n\n") if e.startswith(b"data: ")]
        assert events[-1] == b"data: [DONE]"
        assert b'"nvext"' in events[-2] and b'"worker_id"' in events[-2] and b'"ttft_ms"' in events[-2]


async def test_client_disconnect_mid_stream_frees_the_load(http: aiohttp.ClientSession) -> None:
    async with fleet(1, engine_kwargs={"chunks": 50, "gap": 0.1}) as (front, states, _):
        body = chat("a long answer please", stream=True)
        async with http.post(front.url + "/v1/chat/completions", json=body) as r:
            await r.content.readuntil(b"\n\n")
            assert states[0].active == 1
            r.close()
        await wait_until(lambda: states[0].active == 0, timeout=3)
        assert states[0].aborted == 1 and states[0].finished == 0

        async def router_load() -> int:
            async with http.get(front.url + "/kvmesh/workers") as w:
                doc = await w.json()
            return sum(row["active_requests"] for row in doc["workers"])

        for _ in range(100):
            if await router_load() == 0:
                break
            await asyncio.sleep(0.02)
        assert await router_load() == 0


async def test_killing_a_worker_loses_no_request_that_had_not_started(http: aiohttp.ClientSession) -> None:
    config = RouterConfig(router_mode="round-robin")
    async with fleet(2, router=config, engine_kwargs={"hold": 0.4}, health_interval=5.0) as (
        front,
        states,
        engines,
    ):

        async def one(i: int) -> tuple[int, str]:
            status, data, _headers = await _post(http, front.url, chat(f"q{i}"))
            return status, data["choices"][0]["message"]["content"] if status == 200 else str(data)

        tasks = [asyncio.create_task(one(i)) for i in range(8)]
        await wait_until(lambda: len(states[1].received) >= 2, timeout=3)
        engines[1].crash()
        results = await asyncio.gather(*tasks)
        assert all(status == 200 for status, _ in results), results
        # e1 had accepted some requests when it died; they were all served again by e0.
        assert len(states[1].received) >= 2
        assert [text for _, text in results] == ["e0"] * 8
        async with http.get(front.url + "/kvmesh/workers") as w:
            rows = {row["url"]: row for row in (await w.json())["workers"]}
        assert rows[engines[1].url]["state"] == "down"
        assert rows[engines[0].url]["state"] == "up"


async def test_bad_requests_get_4xx_never_5xx(http: aiohttp.ClientSession) -> None:
    async with fleet(1, max_body_bytes=4096) as (front, _, _e):
        url = front.url + "/v1/chat/completions"
        cases: list[tuple[dict[str, Any], int, str]] = [
            ({"data": b"{not json"}, 400, "not valid JSON"),
            ({"json": [1, 2]}, 400, "must be a JSON object"),
            ({"json": {"model": "m"}}, 400, "'messages' is a required property"),
            (
                {"json": chat("x", nvext={"agent_hints": {"priority": "high"}})},
                400,
                "nvext.agent_hints.priority",
            ),
            (
                {"json": chat("x", nvext={"backend_instance_id": "http://10.9.9.9:1"})},
                400,
                "unknown worker id",
            ),
            ({"json": chat("x"), "headers": {"x-worker-instance-id": "nobody"}}, 400, "unknown worker id"),
            ({"json": chat("x" * 5000)}, 413, "larger than 4096 bytes"),
        ]
        for kwargs, status, message in cases:
            async with http.post(url, **kwargs) as r:
                doc = await r.json(content_type=None)
                assert r.status == status, (kwargs, doc)
                assert message in doc["error"]["message"], doc


async def test_nvext_is_stripped_and_priority_translated(http: aiohttp.ClientSession) -> None:
    async with fleet(1) as (front, states, engines):
        body = chat("x", nvext={"agent_hints": {"priority": 5}, "extra_fields": ["worker_id"]})
        status, data, _ = await _post(http, front.url, body, headers={"authorization": "Bearer user-key"})
        assert status == 200
        received = states[0].received[-1]
        assert "nvext" not in received
        assert received["priority"] == -5  # lower_first backend (vLLM's polarity)
        assert states[0].headers[-1]["authorization"] == "Bearer user-key"
        url = engines[0].url
        assert data["nvext"] == {
            "worker_id": {
                "prefill_worker_id": url,
                "prefill_dp_rank": 0,
                "decode_worker_id": url,
                "decode_dp_rank": 0,
            }
        }
        assert data["choices"][0]["message"]["content"] == "e0"


async def test_busy_threshold_and_admin_token(http: aiohttp.ClientSession) -> None:
    async with fleet(1, admin_token="s3cret") as (front, _, _e):
        auth = {"authorization": "Bearer s3cret"}
        async with http.get(front.url + "/busy_threshold") as r:
            assert r.status == 401  # one token rule: reads too
        async with http.get(front.url + "/busy_threshold", headers=auth) as r:
            assert r.status == 200
            assert (await r.json())["thresholds"] == [
                {
                    "model": "test-model",
                    "active_decode_blocks_threshold": None,
                    "active_prefill_tokens_threshold": None,
                    "active_prefill_tokens_threshold_frac": None,
                }
            ]
        async with http.post(
            front.url + "/busy_threshold", json={"active_decode_blocks_threshold": 0.5}
        ) as r:
            assert r.status == 401
        async with http.post(
            front.url + "/busy_threshold", json={"active_decode_blocks_threshold": 0.5}, headers=auth
        ) as r:
            assert r.status == 200
            assert (await r.json())["active_decode_blocks_threshold"] == 0.5
        async with http.post(
            front.url + "/busy_threshold", json={"active_decode_blocks_threshold": 7}, headers=auth
        ) as r:
            assert r.status == 400
            assert "--active-decode-blocks-threshold" in (await r.json())["error"]["message"]


async def test_metrics_health_and_models(http: aiohttp.ClientSession) -> None:
    async with fleet(2) as (front, _, _e):
        status, _, _h = await _post(http, front.url, chat("hello"))
        assert status == 200
        async with http.get(front.url + "/metrics") as r:
            text = await r.text()
        for name in (
            "kvmesh_requests_total",
            "kvmesh_router_overhead_seconds_bucket",
            'phase="hashing"',
            "kvmesh_worker_active_decode_blocks",
            "kvmesh_cached_tokens_reported_total",
            "kvmesh_time_to_first_token_seconds",
        ):
            assert name in text, name
        async with http.get(front.url + "/health") as r:
            assert r.status == 200 and (await r.json())["workers_up"] == 2
        for ping in (http.get, http.post):  # (vLLM's name for it, either method)
            async with ping(front.url + "/ping") as r:
                assert r.status == 200 and (await r.json())["workers_up"] == 2
        async with http.get(front.url + "/v1/models") as r:
            assert [m["id"] for m in (await r.json())["data"]] == ["test-model"]


async def test_a_request_sent_during_discovery_waits_for_it(http: aiohttp.ClientSession) -> None:
    """The router answers as soon as it listens; a request that arrives before the workers have
    described themselves waits for that, instead of seeing an empty fleet (503)."""
    async with fleet(2, engine_kwargs={"info_delay": 0.5, "block_size": 32}) as (front, states, _):
        body = chat("early bird " * 30, nvext={"extra_fields": ["worker_id"]})
        async with http.post(front.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200, await r.text()
        async with http.get(front.url + "/kvmesh/workers") as r:
            rows = (await r.json())["workers"]
        assert {row["block_size"] for row in rows} == {32}
        assert sum(len(s.received) for s in states) == 1


async def test_a_client_leaving_during_a_long_prefill_aborts_it_on_the_worker(
    http: aiohttp.ClientSession,
) -> None:
    """Before the worker's first byte the router holds the response (to fail over); a client that
    gives up meanwhile must still reach the worker as a disconnect, and free its load at once."""
    async with fleet(1, engine_kwargs={"hold": 3.0}) as (front, states, _):
        with contextlib.suppress(asyncio.TimeoutError):
            await http.post(
                front.url + "/v1/chat/completions",
                json=chat("a long prompt " * 50),
                timeout=aiohttp.ClientTimeout(total=0.3),
            )
        for _ in range(100):
            if states[0].aborted:
                break
            await asyncio.sleep(0.02)
        assert states[0].aborted == 1  # well before the 3 s prefill would have ended
        async with http.get(front.url + "/kvmesh/workers") as r:
            (row,) = (await r.json())["workers"]
        assert row["active_requests"] == 0


async def test_a_prompt_the_tokenizer_cannot_render_is_a_400_naming_the_field(
    http: aiohttp.ClientSession,
) -> None:
    """A body that passes the shape checks but breaks the tokenizer or its chat template (a tool
    call whose ``function`` is not an object; a template that raises on role order) is the
    client's mistake: a 400 naming the field, never a 500, and no load is left behind."""
    async with fleet(1) as (front, states, _):
        body = {
            "model": "test-model",
            "messages": [
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [{"function": "get_weather"}]},
            ],
        }
        status, doc, _h = await _post(http, front.url, body)
        assert status == 400, doc
        assert doc["error"]["param"] == "messages"
        assert "tokenize" in doc["error"]["message"]
        assert states[0].received == []
        async with http.post(front.url + "/v1/completions", json={"model": "m", "prompt": "ok"}) as r:
            assert r.status == 200
        async with http.get(front.url + "/kvmesh/workers") as r:
            (row,) = (await r.json())["workers"]
        assert row["active_requests"] == 0


async def test_headers_named_in_connection_are_not_forwarded(http: aiohttp.ClientSession) -> None:
    """RFC 9110 section 7.6.1: a header the client lists in ``Connection`` is for this hop only."""
    async with fleet(1) as (front, states, _):
        headers = {"connection": "keep-alive, X-Hop-Secret", "x-hop-secret": "s", "x-end-to-end": "e"}
        status, _d, _h = await _post(http, front.url, chat("hello"), headers=headers)
        assert status == 200
        seen = states[0].headers[-1]
        assert "x-hop-secret" not in seen
        assert seen["x-end-to-end"] == "e"


async def test_an_unknown_worker_id_is_refused_naming_the_field_that_carried_it(
    http: aiohttp.ClientSession,
) -> None:
    async with fleet(1) as (front, states, engines):
        known = engines[0].url
        cases: list[tuple[dict[str, Any], dict[str, str], str]] = [
            ({"decode_worker_id": "nobody"}, {}, "nvext.decode_worker_id"),
            ({"prefill_worker_id": "nobody"}, {}, "nvext.prefill_worker_id"),
            ({"decode_worker_id": known, "prefill_worker_id": "nobody"}, {}, "nvext.prefill_worker_id"),
            ({"backend_instance_id": known}, {"x-prefill-instance-id": "nobody"}, "x-prefill-instance-id"),
            ({"backend_instance_id": "nobody"}, {}, "nvext.backend_instance_id"),
            ({}, {"x-worker-instance-id": "nobody"}, "x-worker-instance-id"),
        ]
        for nvext, headers, field in cases:
            status, doc, _h = await _post(http, front.url, chat("x", nvext=nvext), headers=headers)
            assert status == 400, (nvext, headers, doc)
            assert doc["error"]["param"] == field, (nvext, headers, doc)
            assert "unknown worker id 'nobody'" in doc["error"]["message"]
        assert states[0].received == []
        status, _d, _h = await _post(http, front.url, chat("x", nvext={"decode_worker_id": known}))
        assert status == 200


async def test_a_request_pinned_to_a_worker_that_is_down_gets_503_with_retry_after(
    http: aiohttp.ClientSession,
) -> None:
    """The id is valid (the worker is registered), the worker is only unavailable: a retryable 503,
    not a 400 'unknown worker' that tells the client its request is wrong."""
    async with fleet(2) as (front, _states, engines):
        down = engines[1].url
        engines[1].crash()

        async def states() -> dict[str, str]:
            async with http.get(front.url + "/kvmesh/workers") as r:
                return {w["worker_id"]: w["state"] for w in (await r.json())["workers"]}

        for _ in range(250):
            if (await states())[down] == "down":
                break
            await asyncio.sleep(0.02)
        assert (await states())[down] == "down"
        for nvext, headers in (({"backend_instance_id": down}, {}), ({}, {"x-worker-instance-id": down})):
            status, doc, response_headers = await _post(
                http, front.url, chat("x", nvext=nvext), headers=headers
            )
            assert status == 503, doc
            assert "down" in doc["error"]["message"]
            assert int(response_headers["retry-after"]) >= 1


@pytest.mark.parametrize("mode", ["round-robin", "random"])
@pytest.mark.parametrize("hint", ["kv_overlap_score_credit", "kv_overlap_score_weight"])
async def test_a_cost_hint_to_a_router_without_a_cost_is_a_400_naming_it(
    http: aiohttp.ClientSession, mode: str, hint: str
) -> None:
    async with fleet(1, router=RouterConfig(router_mode=mode)) as (front, states, _e):  # type: ignore[arg-type]
        body = chat("q", nvext={"agent_hints": {hint: 0.5}})
        status, data, _headers = await _post(http, front.url, body)
        assert status == 400
        assert data["error"]["param"] == f"nvext.agent_hints.{hint}"
        assert not states[0].received  # nothing reached the engine
        status, _data, _headers = await _post(http, front.url, chat("q"))
        assert status == 200
