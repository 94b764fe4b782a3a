"""Fake of ``tensorrt_llm/serve/openai_server.py`` (class ``OpenAIServer``), 1.2 shape.

Mirrors: ``__init__(generator, model, tool_parser, server_role, metadata_server_cfg,
disagg_cluster_config, multimodal_server_config, chat_template)`` (1.0/1.1 named the first
argument ``llm``: set ``OpenAIServer.FIRST_ARG = "llm"`` to get that shape); ``self.app =
FastAPI(lifespan=...)``; routes ``/health``, ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions`` and ``POST /kv_cache_events`` (drains ``get_kv_cache_events_async``,
treating ``IndexError`` / ``asyncio.QueueEmpty`` as the end); the pure-ASGI
``ServerArrivalTimeMiddleware`` added last in ``__init__``; ``async __call__(host, port, sockets)``
that serves ``self.app`` with uvicorn. Completions report ``usage.prompt_tokens_details.cached_tokens``
from the result's ``cached_tokens``, as ``serve/postprocess_handlers.py`` does.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tensorrt_llm.llmapi.llm import SamplingParams

RUNNING: list = []
"""uvicorn servers started by __call__ (tests stop them through this list)."""


class ServerArrivalTimeMiddleware:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            scope.setdefault("state", {})["server_arrival_time"] = time.monotonic()
        await self.app(scope, receive, send)


class OpenAIServer:
    FIRST_ARG = "generator"

    def __init__(self, *args, **kwargs):
        engine = kwargs.pop(self.FIRST_ARG) if self.FIRST_ARG in kwargs else args[0]
        setattr(self, self.FIRST_ARG, engine)
        self.model = kwargs.get("model", args[1] if len(args) > 1 else None)

        @asynccontextmanager
        async def lifespan(app):
            yield
            engine.shutdown()

        self.app = FastAPI(lifespan=lifespan)
        self.app.add_api_route("/health", self.health, methods=["GET"])
        self.app.add_api_route("/v1/models", self.get_model, methods=["GET"])
        self.app.add_api_route("/kv_cache_events", self.get_kv_cache_events, methods=["POST"])
        self.app.add_api_route("/v1/completions", self.openai_completion, methods=["POST"])
        self.app.add_api_route("/v1/chat/completions", self.openai_chat, methods=["POST"])
        self.app.add_middleware(ServerArrivalTimeMiddleware)

    @property
    def _engine(self):
        return getattr(self, self.FIRST_ARG)

    async def health(self):
        return JSONResponse({})

    async def get_model(self):
        return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def get_kv_cache_events(self):
        events = []
        try:
            async for event in self._engine.get_kv_cache_events_async(0):
                events.append(event)
        except (IndexError, asyncio.QueueEmpty):
            pass
        return JSONResponse(content=events)

    async def _complete(self, prompt, body, kind):
        allowed = {"model", "prompt", "messages", "max_tokens", "stream", "temperature"}
        unknown = set(body) - allowed
        if unknown:  # trtllm's protocol models forbid unknown fields
            return JSONResponse({"error": f"unknown fields {sorted(unknown)}"}, status_code=400)
        result = self._engine.generate_async(prompt, SamplingParams(max_tokens=body.get("max_tokens") or 2))
        result = await result.aresult()
        usage = {
            "prompt_tokens": len(result.prompt_token_ids),
            "completion_tokens": len(result.outputs[0].token_ids),
            "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
        }
        text = result.outputs[0].text
        choice = (
            {"index": 0, "text": text}
            if kind == "text_completion"
            else {"index": 0, "message": {"role": "assistant", "content": text}}
        )
        return JSONResponse(
            {"id": "cmpl-fake", "object": kind, "model": self.model, "choices": [choice], "usage": usage}
        )

    async def openai_completion(self, request: Request):
        body = await request.json()
        return await self._complete(body["prompt"], body, "text_completion")

    async def openai_chat(self, request: Request):
        body = await request.json()
        prompt = "".join(f"<{m['role']}>{m['content']}" for m in body["messages"])
        return await self._complete(prompt, body, "chat.completion")

    async def __call__(self, host, port, sockets=None):
        config = uvicorn.Config(self.app, host=host, port=port, log_level="warning")
        server = uvicorn.Server(config)
        RUNNING.append(server)
        await server.serve(sockets=sockets)
