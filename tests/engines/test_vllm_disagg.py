"""Disaggregated routing against real vLLM 0.33.0 request handling (engine tier, CPU).

Two stand-in vLLM servers (a prefill and a decode worker) validate every body kvmesh sends them with
vLLM's own ``ChatCompletionRequest`` and turn it into ``SamplingParams`` the way vLLM's chat serving
does; ``kv_transfer_params`` must arrive in ``SamplingParams.extra_args``, which is where vLLM's
scheduler hands it to the KV connector. The prefill stand-in answers with the transfer parameters a
NIXL connector returns. Only the model is missing: no GPU here.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from typing import Any

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # torch's, at import
    import aiohttp
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

from kvmesh.router.asgi.standalone import build_router_app
from kvmesh.router.core.config import RouterConfig
from kvmesh.router.mesh.settings import MeshSettings, WorkerSpec
from tests.router.servers import serve

pytestmark = pytest.mark.engine_vllm

# What vLLM's NIXL connector puts in a prefill answer (field names from its request_finished).
NIXL_ANSWER = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [0, 1, 2],
    "remote_engine_id": "prefill-engine",
    "remote_request_id": "req-1",
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
    "tp_size": 1,
}


def vllm_stand_in(role: str, seen: list[dict[str, Any]]) -> Starlette:
    async def info(request: Request) -> Response:
        return JSONResponse(
            {
                "backend": "vllm",
                "role": role,
                "model": "m",
                "block_size": 16,
                "dp_size": 1,
                "kv_events_endpoints": [],
                "max_num_batched_tokens": 8192,
                "total_kv_blocks": 1000,
                "priority_polarity": "lower_first",
            }
        )

    async def chat(request: Request) -> Response:
        raw = await request.body()
        parsed = ChatCompletionRequest.model_validate_json(raw)  # vLLM's own validation
        # as vLLM's serving does: the request's token limit (max_tokens is a deprecated alias)
        params = parsed.to_sampling_params(json.loads(raw).get("max_tokens") or 16, {})
        seen.append(
            {"body": json.loads(raw), "extra_args": params.extra_args, "max_tokens": params.max_tokens}
        )
        if not parsed.stream:
            answer: dict[str, Any] = {
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "created": 0,
                "model": parsed.model,
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "length"}
                ],
                "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11},
            }
            if role == "prefill":
                answer["kv_transfer_params"] = NIXL_ANSWER
            return JSONResponse(answer)

        async def events() -> Any:
            chunk = {
                "id": "c",
                "object": "chat.completion.chunk",
                "model": "m",
                "choices": [{"index": 0, "delta": {"content": "ok"}}],
            }
            yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    return Starlette(
        routes=[
            Route("/kvmesh/info", info),
            Route("/health", health),
            Route("/v1/chat/completions", chat, methods=["POST"]),
        ]
    )


async def test_both_stage_bodies_pass_vllm_validation_and_reach_sampling_params() -> None:
    prefill_seen: list[dict[str, Any]] = []
    decode_seen: list[dict[str, Any]] = []
    async with contextlib.AsyncExitStack() as stack:
        p = await stack.enter_async_context(serve(vllm_stand_in("prefill", prefill_seen)))
        d = await stack.enter_async_context(serve(vllm_stand_in("decode", decode_seen)))
        settings = MeshSettings(
            workers=(WorkerSpec(d.url, "d0"),),
            prefill_workers=(WorkerSpec(p.url, "p0"),),
            router=RouterConfig(use_kv_events=False),
        )
        front = await stack.enter_async_context(serve(build_router_app(settings)))
        http = await stack.enter_async_context(aiohttp.ClientSession())
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": "hello there"}],
            "max_tokens": 9,
            "stream": True,
            "nvext": {"agent_hints": {"priority": 2}},
        }
        async with http.post(front.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200, await r.text()
            assert b"ok" in await r.read()
    (prefill,), (decode,) = prefill_seen, decode_seen
    assert prefill["max_tokens"] == 1
    assert prefill["extra_args"]["kv_transfer_params"]["do_remote_decode"] is True
    assert prefill["body"]["priority"] == -2  # vLLM's polarity on both stages
    assert decode["extra_args"]["kv_transfer_params"] == NIXL_ANSWER
    assert decode["max_tokens"] == 9 and decode["body"]["priority"] == -2
