"""A tiny OpenAI-compatible engine for middleware tests (no KV cache, no events).

It records what it received, streams a fixed number of chunks with a fixed gap, reports
``usage.prompt_tokens_details.cached_tokens`` and keeps a live count of requests in flight, so a
test can see a client disconnect reach the worker.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


@dataclass
class EngineState:
    name: str
    block_size: int = 16
    chunks: int = 4
    gap: float = 0.0
    hold: float = 0.0  # seconds before the response head (a long prefill)
    info_delay: float = 0.0  # seconds before /kvmesh/info answers (slow discovery)
    polarity: str = "lower_first"
    backend: str = "test"
    role: str = "aggregated"
    transfer_params: dict[str, Any] | None = None  # a prefill answer's kv_transfer_params
    status: int = 200  # of every generation answer (a failing prefill worker: 500)
    stream_error: int | None = None  # a stream opens with an error event of this code, in a 200
    # (vLLM's answer to a streamed request while paused: 503), and ends there
    text: str | None = None  # each streamed chunk's content (default "<name>:<i> ")
    stream_usage: bool = True  # end a stream with a usage event
    tool_calls: list[dict[str, str]] = field(default_factory=list)  # answer with these calls
    # ({"name", "arguments"}, no text), streamed as OpenAI does: a call's id and name, then its
    # arguments in two pieces
    dp_size: int = 1
    info_facts: dict[str, Any] = field(default_factory=dict)  # override /kvmesh/info's facts
    kv_state: Any = None  # the body /kvmesh/kv_state answers (404 when None)
    metrics: str | None = None  # the Prometheus page /metrics serves (404 when None)
    ready: int | None = None  # the status SGLang's GET /ready answers (404 when None)
    is_paused: bool | None = None  # what vLLM's GET /is_paused answers (404 when None)
    pause_asks: int = 0  # GET /ready and /is_paused asked
    stored: dict[str, dict[str, Any]] = field(default_factory=dict)  # GET /v1/responses/{id} answers
    stored_asks: list[tuple[str, str | None]] = field(default_factory=list)  # (id, authorization)
    stored_delay: float = 0.0  # seconds before GET /v1/responses/{id} answers
    received: list[dict[str, Any]] = field(default_factory=list)
    rpcs: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # worker RPCs, in order
    headers: list[dict[str, str]] = field(default_factory=list)
    session_ids: list[list[str]] = field(default_factory=list)  # every X-Session-ID, repeats kept
    active: int = 0
    finished: int = 0
    aborted: int = 0
    chunk_times: list[float] = field(default_factory=list)


def _whole_calls(state: EngineState) -> list[dict[str, Any]]:
    return [
        {"id": f"call_{i}", "type": "function", "function": dict(call)}
        for i, call in enumerate(state.tool_calls)
    ]


def _call_pieces(state: EngineState) -> list[dict[str, Any]]:
    pieces: list[dict[str, Any]] = []
    for i, call in enumerate(state.tool_calls):
        name, arguments = call["name"], call["arguments"]
        half = len(arguments) // 2
        pieces.append(
            {"index": i, "id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": ""}}
        )
        pieces += [
            {"index": i, "function": {"arguments": part}} for part in (arguments[:half], arguments[half:])
        ]
    return pieces


def engine_app(state: EngineState) -> Starlette:
    async def info(request: Request) -> Response:
        if state.info_delay:
            await asyncio.sleep(state.info_delay)
        return JSONResponse(
            {
                "backend": state.backend,
                "role": state.role,
                "model": "test-model",
                "block_size": state.block_size,
                "dp_size": state.dp_size,
                "kv_events_endpoints": [],
                "kv_replay_endpoints": [],
                "max_num_batched_tokens": 8192,
                "total_kv_blocks": 10000,
                "priority_polarity": state.polarity,
                **state.info_facts,
            }
        )

    async def session_control(request: Request) -> Response:
        state.rpcs.append(("session_control", await request.json()))
        return JSONResponse({"status": "ok"})

    async def pin_prefix(request: Request) -> Response:
        body = await request.json()
        state.rpcs.append(("pin_prefix", body))
        return JSONResponse(
            {"status": "ok", "blocks_pinned": len(body.get("token_ids", [])) // state.block_size}
        )

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def metrics(request: Request) -> Response:
        if state.metrics is None:
            return Response(status_code=404)
        return Response(state.metrics, media_type="text/plain; version=0.0.4")

    async def kv_state(request: Request) -> Response:
        if state.kv_state is None:
            return Response(status_code=404)
        return JSONResponse(state.kv_state)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "test-model", "object": "model"}]})

    async def generate(request: Request) -> Response:
        body = await request.json()
        state.received.append(body)
        state.headers.append(dict(request.headers))
        state.session_ids.append(request.headers.getlist("x-session-id"))
        if state.hold:  # a long prefill that, like a real engine, stops when its client leaves
            deadline = time.perf_counter() + state.hold
            while time.perf_counter() < deadline:
                if await request.is_disconnected():
                    state.aborted += 1
                    return Response(status_code=499)
                await asyncio.sleep(0.02)
        if state.status != 200:
            return JSONResponse(
                {"error": {"message": "failing on purpose", "code": state.status}}, state.status
            )
        usage = {
            "prompt_tokens": 100,
            "completion_tokens": state.chunks,
            "total_tokens": 100 + state.chunks,
            "prompt_tokens_details": {"cached_tokens": 32},
        }
        if not body.get("stream"):
            message: dict[str, Any] = {"role": "assistant", "content": state.name}
            if state.tool_calls:
                message = {"role": "assistant", "content": None, "tool_calls": _whole_calls(state)}
            answer: dict[str, Any] = {
                "id": "cmpl-1",
                "object": "chat.completion",
                "model": "test-model",
                "choices": [{"index": 0, "message": message}],
                "usage": usage,
            }
            transfer = body.get("kv_transfer_params")
            if isinstance(transfer, dict) and transfer.get("do_remote_decode") and state.transfer_params:
                answer["kv_transfer_params"] = state.transfer_params
            return JSONResponse(answer)

        async def events() -> Any:
            state.active += 1
            try:
                if state.stream_error is not None:
                    error = {"message": "refused in the stream", "type": "Error", "param": None}
                    yield f"data: {json.dumps({'error': {**error, 'code': state.stream_error}})}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                for piece in _call_pieces(state):
                    chunk = {
                        "id": "chatcmpl-1",
                        "object": "chat.completion.chunk",
                        "model": "test-model",
                        "choices": [{"index": 0, "delta": {"tool_calls": [piece]}}],
                    }
                    yield f"data: {json.dumps(chunk)}\n\n"
                for i in range(0 if state.tool_calls else state.chunks):
                    if i and state.gap:
                        await asyncio.sleep(state.gap)
                    state.chunk_times.append(time.perf_counter())
                    chunk = {
                        "id": "chatcmpl-1",
                        "object": "chat.completion.chunk",
                        "model": "test-model",
                        "choices": [{"index": 0, "delta": {"content": state.text or f"{state.name}:{i} "}}],
                    }
                    yield f"data: {json.dumps(chunk)}\n\n"
                final = {
                    "id": "chatcmpl-1",
                    "object": "chat.completion.chunk",
                    "model": "test-model",
                    "choices": [],
                    "usage": usage,
                }
                if state.stream_usage:
                    yield f"data: {json.dumps(final)}\n\n"
                yield "data: [DONE]\n\n"
                state.finished += 1
            except asyncio.CancelledError:
                state.aborted += 1
                raise
            finally:
                state.active -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    async def ready(request: Request) -> Response:
        state.pause_asks += 1
        return Response(status_code=state.ready or 404)

    async def is_paused(request: Request) -> Response:
        state.pause_asks += 1
        if state.is_paused is None:
            return Response(status_code=404)
        return JSONResponse({"is_paused": state.is_paused})

    async def stored_response(request: Request) -> Response:
        response_id = request.path_params["response_id"]
        state.stored_asks.append((response_id, request.headers.get("authorization")))
        await asyncio.sleep(state.stored_delay)
        if response_id not in state.stored:
            return JSONResponse({"error": {"message": "not found", "code": 404}}, status_code=404)
        return JSONResponse(state.stored[response_id])

    return Starlette(
        routes=[
            Route("/ready", ready),
            Route("/v1/responses/{response_id}", stored_response),
            Route("/is_paused", is_paused),
            Route("/kvmesh/info", info),
            Route("/kvmesh/session_control", session_control, methods=["POST"]),
            Route("/kvmesh/pin_prefix", pin_prefix, methods=["POST"]),
            Route("/health", health),
            Route("/metrics", metrics),
            Route("/kvmesh/kv_state", kv_state),
            Route("/v1/models", models),
            Route("/v1/chat/completions", generate, methods=["POST"]),
            Route("/v1/completions", generate, methods=["POST"]),
        ]
    )
