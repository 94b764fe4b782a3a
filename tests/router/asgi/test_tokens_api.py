"""vLLM's token-in-token-out API through kvmesh over HTTP: a standalone router in front of mock
engines, and a mesh of engines each embedding the router.

The mock serves ``/inference/v1/generate`` and its aborts as vLLM 0.33.0 does
(kvmesh.mock.tokens_api). A token prompt is routed on its own ids, so it shares cached blocks with
its completion twin; the router reads the answer's ``usage`` (its cached tokens, its length) and
frees its load; a worker whose server has no token API is never chosen for one; and an abort
reaches the engine running the request, wherever the router sent it.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from kvmesh.commands.demo import start_mesh
from kvmesh.mock.config import MockConfig
from kvmesh.mock.testing import run_mock
from kvmesh.router.asgi.standalone import build_router_app
from kvmesh.router.core.config import RouterConfig
from kvmesh.router.mesh.settings import MeshSettings, WorkerSpec
from tests.mock.test_server import wait_idle
from tests.router.asgi.test_agent_features import BS, mock_fleet, until
from tests.router.asgi.test_generate_api import _vllm_like
from tests.router.asgi.test_responses_api import WORKER, reported_cached, twin_served
from tests.router.servers import serve

PATH = "/inference/v1/generate"
IDS = list(range(2000, 2000 + 6 * BS + 5))


async def tokens(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, Any, str | None]:
    """(status, the answer or the error, or the stream's events; the worker that served it)."""
    async with http.post(url + PATH, json=body) as r:
        worker = r.headers.get(WORKER)
        if r.status != 200 or not body.get("stream"):
            return r.status, await r.json(), worker
        raw = (await r.read()).decode()
    events = [e[len("data: ") :] for e in raw.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]", raw[-300:]
    return 200, [json.loads(e) for e in events[:-1]], worker


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_token_prompt_goes_where_its_completion_twin_is_cached(
    http: aiohttp.ClientSession, stream: bool
) -> None:
    async with mock_fleet(3) as (front, mocks, app):
        twin = {"model": mocks[0].config.model, "prompt": IDS, "max_tokens": 2}
        home, reported_before = await twin_served(http, front.url, app, "/v1/completions", twin)
        body = {
            "token_ids": IDS,
            "sampling_params": {"max_tokens": 5, "ignore_eos": True},
            "stream": stream,
            "stream_options": {"include_usage": True} if stream else None,
            "nvext": {"extra_fields": ["worker_id"]},  # (echoed in the answer's own shape)
        }
        status, answer, worker = await tokens(http, front.url, body)
        assert status == 200, answer
        assert worker == home
        if stream:  # (the echo is an event of its own before [DONE], after the usage event)
            *answer, echo = answer
            assert echo["choices"] == [] and echo["nvext"]["worker_id"]["decode_worker_id"] == home
        else:
            assert answer["nvext"]["worker_id"]["decode_worker_id"] == home
        usage = answer[-1]["usage"] if stream else answer["usage"]
        assert usage["completion_tokens"] == 5
        assert usage["prompt_tokens_details"]["cached_tokens"] == len(IDS) // BS * BS
        decision = app.mesh.router.recent_decisions(1)[-1][1]
        assert decision.cached_tokens == len(IDS) // BS * BS  # routed on the prompt's own ids
        await until(lambda: not app.mesh.router.tracking(decision.request_id))
        # the engine's count of cached tokens, read from the answer's usage
        assert await reported_cached(http, front.url, home) == reported_before + len(IDS) // BS * BS


async def test_n_choices_a_pinned_worker_and_what_is_refused(http: aiohttp.ClientSession) -> None:
    async with mock_fleet(2) as (front, mocks, app):
        other = mocks[1].base_url
        body = {
            "token_ids": IDS[:40],
            "sampling_params": {"n": 2, "max_tokens": 3, "ignore_eos": True},
            "stream": True,  # (no usage asked for: counted by the token ids each event carries)
            "nvext": {"backend_instance_id": other, "agent_hints": {"osl": 3}},
        }
        status, events, worker = await tokens(http, front.url, body)
        assert status == 200, events
        assert worker == other
        made = {0: 0, 1: 0}
        for event in events:
            for choice in event["choices"]:
                made[choice["index"]] += len(choice["token_ids"])
        assert made == {0: 3, 1: 3}
        decision = app.mesh.router.recent_decisions(1)[-1][1]
        await until(lambda: not app.mesh.router.tracking(decision.request_id))
        for bad, field in (
            ({"sampling_params": {}}, "token_ids"),
            ({"token_ids": [1, -1], "sampling_params": {}}, "token_ids"),
            ({"token_ids": [[1, 2], [3]], "sampling_params": {}}, "token_ids"),
            ({"token_ids": [1, 2]}, "sampling_params"),
            ({"token_ids": [1, 2], "sampling_params": {}, "nvext": {"token_data": [1]}}, "nvext.token_data"),
            ({"token_ids": [1, 2], "sampling_params": {}, "nvext": {"cache_control": {"type": "ephemeral"}}},
             "nvext.cache_control"),
            ({"token_ids": [1, 2], "sampling_params": {"logprobs": 1}}, "sampling_params.logprobs"),  # (the mock's)
        ):  # fmt: skip
            status, error, _ = await tokens(http, front.url, bad)
            assert status == 400, error
            assert error["error"]["param"] == field, error


async def test_a_worker_without_the_token_api_is_never_chosen_for_it(http: aiohttp.ClientSession) -> None:
    async with serve(_vllm_like()) as vllm:  # (vLLM started without --enable-scale-out)
        settings = MeshSettings(workers=(WorkerSpec(vllm.url, "v"),), health_interval=0.2)
        async with serve(build_router_app(settings)) as front:
            status, error, _ = await tokens(http, front.url, {"token_ids": IDS, "sampling_params": {}})
            assert status == 404 and "--enable-scale-out" in error["error"]["message"], error
            async with http.post(
                front.url + "/inference/v1/abort_requests", json={"request_ids": ["x"]}
            ) as r:
                assert r.status == 404 and (await r.json())["error"]["param"] == "path"
        async with run_mock(block_size=BS, speedup=50.0) as mock:
            both = MeshSettings(
                workers=(WorkerSpec(vllm.url, "v"), WorkerSpec(mock.base_url, "m")),
                router=RouterConfig(use_kv_events=False),
                health_interval=0.2,
            )
            async with serve(build_router_app(both)) as front:
                for i in range(4):
                    body = {"token_ids": [i, *IDS], "sampling_params": {"max_tokens": 1}}
                    status, answer, worker = await tokens(http, front.url, body)
                    assert status == 200 and worker == "m", answer


async def nothing_runs(mocks: list[Any], app: Any) -> None:
    """Wait until every engine is idle and the router has let its last request go."""
    for mock in mocks:
        await wait_idle(mock.engine)
    decision = app.mesh.router.recent_decisions(1)[-1][1]
    await until(lambda: not app.mesh.router.tracking(decision.request_id))


async def _aborted_stream(http: aiohttp.ClientSession, url: str, abort_at: str, **nvext: Any) -> list[Any]:
    """Start a long stream at ``url``, abort it by its server id at ``abort_at``; its events."""
    body = {
        "request_id": "rollout-7",
        "token_ids": IDS,
        "sampling_params": {"max_tokens": 3000, "ignore_eos": True},
        "stream": True,
        "nvext": nvext,
    }
    events: list[Any] = []
    async with http.post(url + PATH, json=body) as r:
        assert r.status == 200
        async for line in r.content:
            if not line.startswith(b"data: "):
                continue
            payload = line[len(b"data: ") :].strip()
            if payload == b"[DONE]":
                break
            events.append(json.loads(payload))
            if len(events) == 1:
                assert events[0]["request_id"] == "generate-tokens-rollout-7"
                abort = {"request_ids": ["generate-tokens-rollout-7"]}
                async with http.post(abort_at + "/inference/v1/abort_requests", json=abort) as a:
                    assert a.status == 200, await a.text()
    return events


async def test_an_abort_through_the_standalone_router_stops_the_request_where_it_runs(
    http: aiohttp.ClientSession,
) -> None:
    async with mock_fleet(3) as (front, mocks, app):
        events = await _aborted_stream(http, front.url, front.url)
        assert events[-1]["choices"][0]["finish_reason"] == "abort"
        assert sum(len(e["choices"][0]["token_ids"]) for e in events) < 3000
        await nothing_runs(mocks, app)


async def test_an_abort_sent_to_another_engine_of_the_mesh_reaches_the_one_running_the_request(
    http: aiohttp.ClientSession,
) -> None:
    """Each engine embeds the router, and a client reaches any of them: the request was sent to
    one engine and served by another, and the abort reaches a third. Sent only to its own engine,
    the abort stopped nothing, and the request ran on for nobody."""
    async with start_mesh(3, RouterConfig(), MockConfig(block_size=BS, speedup=5.0)) as nodes:
        entry, runner, third = (node.url for node in nodes)
        events = await _aborted_stream(http, entry, third, backend_instance_id=runner)
        assert events[-1]["choices"][0]["finish_reason"] == "abort"
        assert sum(len(e["choices"][0]["token_ids"]) for e in events) < 3000
