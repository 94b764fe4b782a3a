"""The nvext fields the router forwards, against real vLLM 0.33.0 request handling (engine tier, CPU).

A stand-in vLLM server validates every body kvmesh sends with vLLM's own ``ChatCompletionRequest`` /
``CompletionRequest`` and turns it into ``SamplingParams`` as vLLM's serving does, so each field must
arrive under a name vLLM knows (no "extra" field vLLM would ignore), pass vLLM's validation and take
effect in the sampling parameters: ``greed_sampling`` -> greedy sampling, ``max_thinking_tokens`` ->
``thinking_token_budget``, ``token_data`` -> a pre-tokenized ``/v1/completions`` prompt, and a
session's turn -> vLLM's ``X-Session-ID`` header, once.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import AsyncIterator
from typing import Any

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # torch's, at import
    import aiohttp
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.sampling_params import SamplingType

from kvmesh.router.asgi.standalone import build_router_app
from kvmesh.router.core.config import RouterConfig
from kvmesh.router.mesh.settings import MeshSettings, WorkerSpec
from tests.router.servers import Server, serve

pytestmark = pytest.mark.engine_vllm


def vllm_stand_in(seen: list[dict[str, Any]]) -> Starlette:
    async def info(request: Request) -> Response:
        return JSONResponse(
            {
                "backend": "vllm",
                "role": "aggregated",
                "model": "m",
                "block_size": 16,
                "dp_size": 1,
                "kv_events_endpoints": [],
                "max_num_batched_tokens": 8192,
                "total_kv_blocks": 1000,
                "priority_polarity": "lower_first",
            }
        )

    async def generate(request: Request) -> Response:
        raw = await request.body()
        model = ChatCompletionRequest if request.url.path.endswith("/chat/completions") else CompletionRequest
        parsed = model.model_validate_json(raw)  # vLLM's own validation; raises on a bad value
        params = parsed.to_sampling_params(16, {})
        seen.append(
            {
                "request": parsed,
                "params": params,
                "extra": dict(parsed.model_extra or {}),  # fields vLLM would ignore
                "session_ids": request.headers.getlist("x-session-id"),
            }
        )
        usage = {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11}
        if model is ChatCompletionRequest:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": "x"}}
        else:
            choice = {"index": 0, "text": "x"}
        return JSONResponse(
            {"id": "1", "object": "x", "created": 0, "model": "m", "choices": [choice], "usage": usage}
        )

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    return Starlette(
        routes=[
            Route("/kvmesh/info", info),
            Route("/health", health),
            Route("/v1/chat/completions", generate, methods=["POST"]),
            Route("/v1/completions", generate, methods=["POST"]),
        ]
    )


@contextlib.asynccontextmanager
async def router_before_vllm() -> AsyncIterator[tuple[Server, list[dict[str, Any]], aiohttp.ClientSession]]:
    seen: list[dict[str, Any]] = []
    async with contextlib.AsyncExitStack() as stack:
        engine = await stack.enter_async_context(serve(vllm_stand_in(seen)))
        settings = MeshSettings(
            workers=(WorkerSpec(engine.url, "v0"),), router=RouterConfig(use_kv_events=False)
        )
        front = await stack.enter_async_context(serve(build_router_app(settings)))
        http = await stack.enter_async_context(aiohttp.ClientSession())
        yield front, seen, http


async def _post(http: aiohttp.ClientSession, url: str, body: dict[str, Any], **kw: Any) -> None:
    async with http.post(url, json=body, **kw) as r:
        assert r.status == 200, await r.text()


def chat(**nvext: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "nvext": nvext}


async def test_greed_sampling_is_vllms_greedy_sampling() -> None:
    async with router_before_vllm() as (front, seen, http):
        body = {**chat(greed_sampling=True), "temperature": 0.9, "top_p": 0.5, "top_k": 40}
        await _post(http, front.url + "/v1/chat/completions", body)
        await _post(http, front.url + "/v1/chat/completions", {**chat(), "temperature": 0.9})
    greedy, sampled = seen
    assert greedy["extra"] == {} and greedy["request"].temperature == 0.0
    assert greedy["params"].sampling_type == SamplingType.GREEDY
    assert sampled["params"].sampling_type == SamplingType.RANDOM  # the control: the field did it


async def test_max_thinking_tokens_is_vllms_thinking_token_budget() -> None:
    async with router_before_vllm() as (front, seen, http):
        await _post(http, front.url + "/v1/chat/completions", chat(max_thinking_tokens=64))
        body = {"model": "m", "prompt": "think", "nvext": {"max_thinking_tokens": 0}}
        await _post(http, front.url + "/v1/completions", body)
    (on_chat, on_completion) = seen
    assert on_chat["extra"] == {} and on_chat["params"].thinking_token_budget == 64
    assert on_completion["extra"] == {} and on_completion["params"].thinking_token_budget == 0


async def test_token_data_is_vllms_pre_tokenized_prompt() -> None:
    ids = [1000 + i for i in range(40)]
    async with router_before_vllm() as (front, seen, http):
        body = {"model": "m", "prompt": "replaced", "nvext": {"token_data": ids}}
        await _post(http, front.url + "/v1/completions", body)
    (seen_request,) = seen
    assert seen_request["extra"] == {}
    assert seen_request["request"].prompt == ids  # vLLM takes a list of ints as token ids


async def test_a_session_turn_reaches_vllm_with_its_session_header_once() -> None:
    async with router_before_vllm() as (front, seen, http):
        await _post(http, front.url + "/v1/chat/completions", chat(session_control={"session_id": "conv-3"}))
        own = {"x-session-id": "mine"}
        await _post(
            http, front.url + "/v1/chat/completions", chat(session_control={"session_id": "c"}), headers=own
        )
        await _post(http, front.url + "/v1/chat/completions", chat())
    assert [s["session_ids"] for s in seen] == [["conv-3"], ["mine"], []]
    assert all(s["extra"] == {} for s in seen)
