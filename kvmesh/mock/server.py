"""The mock engine's OpenAI-compatible HTTP server (a Starlette app, served by uvicorn).

    POST /v1/chat/completions, POST /v1/completions   streaming (SSE, ``data: [DONE]``) or not;
                                                     ``n`` choices (one an event), ``echo``; a
                                                     completions batch of prompts: kvmesh.mock.batches
    POST /v1/chat/completions/batch                  vLLM's batch of conversations, each a chat
                                                     request, answered whole: kvmesh.mock.batches
    POST /v1/responses, GET /v1/responses/{id}       the Responses API, stored answers
                                                     (``previous_response_id``): kvmesh.mock.responses
    POST /v1/messages                                Anthropic's Messages API, as vLLM 0.33.0 serves
                                                     it (``event:`` streams): kvmesh.mock.messages
    POST /generate (PUT too)                         SGLang's native API, as SGLang 0.5.23 has it:
                                                     kvmesh.mock.native_generate (a batch of
                                                     prompts: kvmesh.mock.batches)
    POST /abort_request                              SGLang's abort, of the requests (/generate,
                                                     chat, completions) a ``rid`` names, or of all:
                                                     kvmesh.mock.sglang_abort
    POST /inference/v1/generate                      vLLM's token-in-token-out API, and its abort
    POST /inference/v1/abort_requests                (``/abort_requests`` too), as vLLM 0.33.0 has
                                                     them: kvmesh.mock.tokens_api
    POST /v1/embeddings                              vLLM's embeddings, each input a prefill on the
                                                     engine: kvmesh.mock.embeddings
    POST /api/chat, POST /api/generate,              Ollama's API, as SGLang 0.5.23 serves it
    GET /api/tags, POST /api/show                    (newline-delimited JSON streams):
                                                     kvmesh.mock.ollama
    POST /invocations                                SageMaker's entry point, as vLLM has it (chat,
                                                     completion or embedding by the body; stateful
                                                     sessions): kvmesh.mock.invocations
    POST /v1/messages/count_tokens, POST /tokenize,  vLLM's utility endpoints: kvmesh.mock.tokenize
    POST /detokenize
    POST /pause, /resume, /sleep, /wake_up,          the engine control of an RL loop: vLLM's (dev
    GET  /is_paused, /is_sleeping,                   mode) and SGLang's, kvmesh.mock.control; a
    POST /pause_generation, /continue_generation     request the paused engine refuses is a 503
                                                     (a streamed chat or completion: vLLM's error
                                                     event in a 200 stream)
    GET  /v1/models, GET /health, GET /metrics       (``vllm:cache_config_info`` among the metrics)
    GET  /kv_event_sources                           vLLM's: its KV-event publisher, by DP rank
    /kvmesh/*                                        worker RPCs (kvmesh.worker.rpc); not with
                                                     ``--no-worker-rpc``, as a vLLM without kvmesh

``build_app(engine, middleware=[...])`` returns the app; extra ASGI middleware (for example
kvmesh's router middleware) wraps it exactly as ``vllm serve --middleware`` would wrap vLLM's.
The app's lifespan starts and stops the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import importlib
import inspect
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

import msgspec
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvmesh.errors import ConfigError, RequestError
from kvmesh.mock import tokenize as mock_tokenize
from kvmesh.mock.batches import BatchResponse, batch_response, vertex_response
from kvmesh.mock.control import answers_paused, control_routes
from kvmesh.mock.disconnect import EngineStreamResponse, until_disconnect
from kvmesh.mock.embeddings import embeddings_answer, parse_embeddings, prefill_only
from kvmesh.mock.engine import MockEngine, TokenStream
from kvmesh.mock.invocations import invocations_handler
from kvmesh.mock.messages import message_events, message_object, parse_messages
from kvmesh.mock.native_generate import GenerateRequest, generate_answer, generate_events, parse_generate
from kvmesh.mock.ollama import NDJSON, EmptyPrompt, answer_lines, parse_ollama
from kvmesh.mock.ollama import answer as ollama_answer
from kvmesh.mock.ollama import counts as ollama_counts
from kvmesh.mock.ollama import show as show_model
from kvmesh.mock.ollama import tags as ollama_tags
from kvmesh.mock.protocol import Endpoint, ParsedRequest, parse_generation, usage
from kvmesh.mock.responses import (
    ResponseStore,
    new_response_id,
    not_found,
    parse_responses,
    remember,
    response_events,
    response_object,
    responses_usage,
)
from kvmesh.mock.running import RunningRequests
from kvmesh.mock.sglang_abort import abort_request, request_rid
from kvmesh.mock.sglang_sessions import session_routes, unknown_session
from kvmesh.mock.tokens_api import parse_tokens, tokens_answer, tokens_events
from kvmesh.router.request.batches import CHAT_BATCH_PATH, COMPLETIONS_PATH
from kvmesh.router.request.generate_api import ABORT_PATH as SGLANG_ABORT_PATH
from kvmesh.router.request.generate_api import GENERATE_PATH
from kvmesh.router.request.invocations import INVOCATIONS_PATH
from kvmesh.router.request.ollama_api import (
    OLLAMA_PATHS,
    OLLAMA_SHOW_PATH,
    OLLAMA_TAGS_PATH,
    moved_routes,
    ollama_route,
)
from kvmesh.router.request.tokenizer import EOS, BuiltinTokenizer
from kvmesh.router.request.tokens_api import ABORT_PATHS, TOKENS_PATH, abort_ids
from kvmesh.router.request.vertex_api import vertex_route
from kvmesh.worker.rpc import error_response, worker_rpc_routes

_encode = msgspec.json.Encoder().encode
_DONE = b"data: [DONE]\n\n"
_P = TypeVar("_P")


class _TokenText:
    """Text of the mock's output tokens (builtin vocabulary), cached per id."""

    def __init__(self) -> None:
        self._tok = BuiltinTokenizer()
        self._cache: dict[int, str] = {EOS: ""}

    def __call__(self, ids: list[int]) -> str:
        cache = self._cache
        parts = []
        for i in ids:
            text = cache.get(i)
            if text is None:
                text = cache[i] = self._tok.decode([i])
            parts.append(text)
        return "".join(parts)


def build_app(
    engine: MockEngine,
    *,
    middleware: Sequence[Middleware] = (),
    admin_token: str | None = None,
) -> Starlette:
    """The engine's ASGI app; ``middleware`` wraps it (outermost first), as Starlette applies it."""
    token = admin_token if admin_token is not None else engine.config.admin_token
    text_of = _TokenText()
    model = engine.config.model
    created_at = int(time.time())
    running_rids = RunningRequests()  # (by SGLang's rid, for /abort_request)

    async def generate(request: Request, endpoint: Endpoint) -> Response:
        def parse(body: Any, session: str | None) -> tuple[ParsedRequest, str | None] | BatchResponse:
            if endpoint == "completions":
                batch = batch_response(body, COMPLETIONS_PATH, lambda item: parse(item, session), completions)
                if batch is not None:
                    return batch
            parsed = parse_generation(body, endpoint, engine.config, engine.tokenizer, session)
            return parsed, request_rid(body)

        read = await _read_request(request, parse)
        if isinstance(read, (Response, BatchResponse)):
            return read  # type: ignore[return-value]
        parsed, rid = read
        prefix = "chatcmpl" if endpoint == "chat" else "cmpl"
        response_id = f"{prefix}-{request.headers.get('x-request-id') or uuid.uuid4().hex}"
        request_id = uuid.uuid4().hex
        transfer = parsed.kv_transfer_params
        if not await _pull_prefix(engine, request, parsed):
            return Response(status_code=499)
        streams = _submit_choices(engine, parsed, request_id)
        running_rids.add(rid, streams)

        def abort() -> None:
            for stream in streams:
                engine.abort(stream.request_id)

        events = _sse(streams, parsed, response_id, text_of) if parsed.stream else None
        header = [(b"x-request-id", response_id.encode())]
        served = await _served(request, running_rids, rid, streams, events, abort, header)
        if served is not None:
            return served
        if any(stream.stopped for stream in streams):
            abort()
            return error_response("the engine stopped before the request finished", 503)
        answer = _full_response(streams, parsed, response_id, text_of)
        if transfer is not None and transfer.get("do_remote_decode"):
            answer["kv_transfer_params"] = _handoff(engine, request, parsed, request_id)
        return JSONResponse(answer, headers={"x-request-id": response_id})

    @answers_paused
    async def chat_completions(request: Request) -> Response:
        return await generate(request, "chat")

    async def chat_batch(request: Request) -> Response:
        def parse(body: Any, session: str | None) -> BatchResponse:
            if not isinstance(body, dict):
                raise RequestError("the request body must be a JSON object", field="body")
            batch = batch_response(
                body,
                CHAT_BATCH_PATH,
                lambda item: parse_generation(item, "chat", engine.config, engine.tokenizer, session),
                chat_completions,
            )
            assert batch is not None  # (a chat batch is one whatever its size)
            return batch

        read = await _read_request(request, parse)  # (a BatchResponse is an ASGI answer too)
        return read  # type: ignore[return-value]

    stored = ResponseStore()

    @answers_paused
    async def responses(request: Request) -> Response:
        parsed = await _read_request(
            request,
            lambda body, session: parse_responses(body, engine.config, engine.tokenizer, stored, session),
        )
        if isinstance(parsed, Response):
            return parsed
        response_id = new_response_id()
        streams = _submit_choices(engine, parsed.chat, uuid.uuid4().hex)
        only = streams[0]

        def abort() -> None:
            engine.abort(only.request_id)

        if parsed.chat.stream:
            return EngineStreamResponse(
                response_events(
                    parsed,
                    response_id,
                    _pieces(only, text_of),
                    lambda: None if only.finish_reason == "abort" else _usage([only]),
                    functools.partial(remember, stored, parsed),
                ),
                abort,
            )  # type: ignore[return-value]
        if not await until_disconnect(request.receive, only.wait()):
            abort()
            return Response(status_code=499)
        if only.finish_reason == "abort":
            return error_response("the engine stopped before the request finished", 503)
        whole = response_object(
            parsed,
            response_id,
            int(time.time()),
            text=text_of(only.tokens),
            usage=responses_usage(_usage(streams)),
            status="completed",
        )
        remember(stored, parsed, whole)
        return JSONResponse(whole)

    async def stored_response(request: Request) -> Response:
        response_id = request.path_params["response_id"]
        whole = stored.response(response_id)
        if whole is None:
            return error_response(not_found(response_id), 404, "response_id")
        return JSONResponse(whole)

    @answers_paused
    async def messages(request: Request) -> Response:
        parsed = await _read_request(
            request, lambda body, session: parse_messages(body, engine.config, engine.tokenizer, session)
        )
        if isinstance(parsed, Response):
            return parsed
        # (vLLM's id is the chat answer's it converts)
        message_id = f"chatcmpl-{request.headers.get('x-request-id') or uuid.uuid4().hex}"
        only = _submit_choices(engine, parsed, uuid.uuid4().hex)[0]

        def abort() -> None:
            engine.abort(only.request_id)

        if parsed.stream:
            events = message_events(
                parsed,
                message_id,
                _pieces(only, text_of),
                lambda: None if only.finish_reason == "abort" else (only.finish_reason, _usage([only])),
            )
            return EngineStreamResponse(events, abort, headers=[(b"x-request-id", message_id.encode())])  # type: ignore[return-value]
        if not await until_disconnect(request.receive, only.wait()):
            abort()
            return Response(status_code=499)
        if only.finish_reason == "abort":
            return error_response("the engine stopped before the request finished", 503)
        whole = message_object(parsed, message_id, text_of(only.tokens), only.finish_reason, _usage([only]))
        return JSONResponse(whole, headers={"x-request-id": message_id})

    @answers_paused
    async def completions(request: Request) -> Response:
        return await generate(request, "completions")

    async def ollama_show(request: Request) -> Response:
        read = await _read_request(request, lambda body, _: show_model(body, engine.config.model_len))
        return read if isinstance(read, Response) else JSONResponse(read)

    ollama_endpoints = moved_routes(os.environ)

    @answers_paused
    async def ollama(request: Request) -> Response:
        path = ollama_endpoints.get(request.url.path, request.url.path)  # (moved: SGLang's variables)
        started_ns = time.time_ns()
        read = await _read_request(
            request, lambda body, session: parse_ollama(body, path, engine.config, engine.tokenizer, session)
        )
        if isinstance(read, Response):
            return read
        if isinstance(read, EmptyPrompt):  # (answered at once, done)
            whole = ollama_answer(path, model, "", done=True)
            if read.stream:
                return Response(whole + b"\n", media_type=NDJSON.decode())
            return Response(whole, media_type="application/json")
        only = _submit_choices(engine, read, uuid.uuid4().hex)[0]

        def abort() -> None:
            engine.abort(only.request_id)

        if read.stream:
            lines = answer_lines(path, model, _pieces(only, text_of), lambda: only.finish_reason != "abort")
            return EngineStreamResponse(lines, abort, content_type=NDJSON)  # type: ignore[return-value]
        if not await until_disconnect(request.receive, only.wait()):
            abort()
            return Response(status_code=499)
        if only.finish_reason == "abort":
            return error_response("the engine stopped before the request finished", 503)
        figures = ollama_counts(only.prompt_tokens, len(only.tokens), started_ns)
        whole = ollama_answer(path, model, text_of(only.tokens), done=True, counts=figures)
        return Response(whole, media_type="application/json")

    @answers_paused
    async def native_generate(request: Request) -> Response:
        def parse(body: Any, session: str | None) -> GenerateRequest | BatchResponse:
            batch = batch_response(body, GENERATE_PATH, lambda item: parse(item, session), native_generate)
            if batch is not None:
                return batch
            refused = unknown_session(engine, body)
            if refused is not None:  # (a request sent to another engine than its session's)
                raise RequestError(refused, field="session_params.id")
            return parse_generate(body, engine.config, engine.tokenizer, session)

        parsed = await _read_request(request, parse)
        if isinstance(parsed, (Response, BatchResponse)):
            return parsed  # type: ignore[return-value]
        streams = _submit_choices(engine, parsed.completion, uuid.uuid4().hex)
        running_rids.add(parsed.rid, streams)

        def abort() -> None:
            for stream in streams:
                engine.abort(stream.request_id)

        events = None
        if parsed.completion.stream:
            events = generate_events(parsed, streams, _interleaved(streams), text_of, engine.clock)
        served = await _served(request, running_rids, parsed.rid, streams, events, abort)
        if served is not None:
            return served
        if any(stream.stopped for stream in streams):
            return error_response("the engine stopped before the request finished", 503)
        return JSONResponse(generate_answer(parsed, streams, text_of, engine.clock()))

    async def vertex_generate(request: Request) -> Response:
        def parse(body: Any, session: str | None) -> Response:
            def read_one(item: dict[str, Any]) -> object:
                return parse_generate(item, engine.config, engine.tokenizer, session)

            return vertex_response(body, read_one, native_generate)

        return await _read_request(request, parse)

    running_tokens = RunningRequests()  # (by the server's id, for abort_requests)

    @answers_paused
    async def tokens(request: Request) -> Response:
        header_id = request.headers.get("x-request-id")
        parsed = await _read_request(
            request,
            lambda body, session: parse_tokens(body, engine.config, engine.tokenizer, session, header_id),
        )
        if isinstance(parsed, Response):
            return parsed
        completion = parsed.completion
        if not await _pull_prefix(engine, request, completion):
            return Response(status_code=499)
        request_id = uuid.uuid4().hex
        streams = _submit_choices(engine, completion, request_id)
        running_tokens.add(parsed.request_id, streams)

        def abort() -> None:
            running_tokens.remove(parsed.request_id, streams)
            for stream in streams:
                engine.abort(stream.request_id)

        events = tokens_events(parsed, streams, _interleaved(streams), text_of) if completion.stream else None
        served = await _served(request, running_tokens, parsed.request_id, streams, events, abort)
        if served is not None:
            return served
        transfer = completion.kv_transfer_params
        handoff = None
        if transfer is not None and transfer.get("do_remote_decode"):
            handoff = _handoff(engine, request, completion, request_id)
        return JSONResponse(tokens_answer(parsed, streams, text_of, int(time.time()), handoff))

    async def abort_requests(request: Request) -> Response:
        ids = await _read_request(request, lambda body, _session: abort_ids(body))
        if isinstance(ids, Response):
            return ids
        for stream in running_tokens.streams(ids):
            engine.abort(stream.request_id, requested=True)
        return Response(status_code=200)

    async def sglang_abort(request: Request) -> Response:
        done = await _read_request(request, lambda body, _session: abort_request(body, engine, running_rids))
        return done if isinstance(done, Response) else Response(status_code=200)

    @answers_paused
    async def embeddings(request: Request) -> Response:
        parsed = await _read_request(
            request, lambda body, _session: parse_embeddings(body, engine.config, engine.tokenizer)
        )
        if isinstance(parsed, Response):
            return parsed
        response_id = f"embd-{request.headers.get('x-request-id') or parsed.request_id or uuid.uuid4().hex}"
        # (the engine's ids are the mock's own: a client's id may come twice at once)
        base_id = uuid.uuid4().hex
        model_len = engine.config.model_len
        streams = [
            engine.submit(prefill_only(ids, parsed.priority, model_len), f"embd-{base_id}-{i}")
            for i, ids in enumerate(parsed.inputs)
        ]

        def abort() -> None:
            for stream in streams:
                engine.abort(stream.request_id)

        served = await _served(request, running_rids, None, streams, None, abort)
        if served is not None:
            return served
        if any(stream.finish_reason == "abort" for stream in streams):
            # (an abort API or a stopping engine ended an input: there is no vector to give)
            return error_response("the engine stopped before the request finished", 503)
        return JSONResponse(embeddings_answer(parsed, model, response_id, int(time.time())))

    async def count_tokens(request: Request) -> Response:
        answer = await _read_request(
            request, lambda body, _: mock_tokenize.count_tokens(body, engine.config, engine.tokenizer)
        )
        return answer if isinstance(answer, Response) else JSONResponse(answer)

    async def tokenize(request: Request) -> Response:
        answer = await _read_request(
            request, lambda body, _: mock_tokenize.tokenize(body, engine.config, engine.tokenizer)
        )
        return answer if isinstance(answer, Response) else JSONResponse(answer)

    async def detokenize(request: Request) -> Response:
        answer = await _read_request(
            request, lambda body, _: mock_tokenize.detokenize(body, engine.tokenizer)
        )
        return answer if isinstance(answer, Response) else JSONResponse(answer)

    async def models(request: Request) -> Response:
        card = {
            "id": model,
            "object": "model",
            "created": created_at,
            "owned_by": "kvmesh",
            "root": model,
            "parent": None,
            "max_model_len": engine.config.model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def metrics(request: Request) -> Response:
        # The engine's own registry plus the process-wide one (where embedded router metrics live).
        data = generate_latest(engine.metrics.registry) + generate_latest(REGISTRY)
        return Response(data, media_type=CONTENT_TYPE_LATEST)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await engine.start()
        try:
            yield
        finally:
            await engine.stop()

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route(CHAT_BATCH_PATH, chat_batch, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/v1/responses/{response_id}", stored_response, methods=["GET"]),
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route(
            INVOCATIONS_PATH, invocations_handler(chat_completions, completions, embeddings), methods=["POST"]
        ),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/generate", native_generate, methods=["POST", "PUT"]),
        Route(vertex_route(os.environ), vertex_generate, methods=["POST"]),
        *(Route(ollama_route(path, os.environ), ollama, methods=["POST"]) for path in sorted(OLLAMA_PATHS)),
        Route(
            ollama_route(OLLAMA_TAGS_PATH, os.environ),
            lambda _: JSONResponse(ollama_tags(model)),
            methods=["GET"],
        ),
        Route(ollama_route(OLLAMA_SHOW_PATH, os.environ), ollama_show, methods=["POST"]),
        Route(TOKENS_PATH, tokens, methods=["POST"]),
        *(Route(path, abort_requests, methods=["POST"]) for path in sorted(ABORT_PATHS)),
        Route(SGLANG_ABORT_PATH, sglang_abort, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/kv_event_sources", lambda _: JSONResponse(engine.kv_event_sources()), methods=["GET"]),
        *control_routes(engine),
        *session_routes(engine),
        *(worker_rpc_routes(engine, admin_token=token) if engine.config.worker_rpc else ()),
    ]
    app = Starlette(routes=routes, middleware=list(middleware), lifespan=lifespan)
    app.state.engine = engine
    return app


def add_middleware(app: Starlette, spec: str) -> None:
    """Add ASGI middleware named ``module:Name`` (or ``module.Name``) the way vLLM's ``--middleware``
    does: a class is added with ``app.add_middleware``, a coroutine function becomes an HTTP
    middleware ``(request, call_next) -> response``."""
    module_name, sep, name = spec.partition(":")
    if not sep:
        module_name, _, name = spec.rpartition(".")
    if not module_name or not name:
        raise ConfigError(f"--middleware must look like module:Name, got {spec!r}")
    try:
        target = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"--middleware {spec!r} cannot be imported: {e}") from None
    if inspect.isclass(target):
        app.add_middleware(target)  # type: ignore[arg-type]
    elif inspect.iscoroutinefunction(target):
        app.add_middleware(BaseHTTPMiddleware, dispatch=target)
    else:
        raise ConfigError(f"--middleware {spec!r} is neither a middleware class nor an async function")


async def _read_request(request: Request, parse: Callable[[Any, str | None], _P]) -> _P | Response:
    """The request's JSON body, read by ``parse`` (with the ``X-Session-ID`` header), or the 400 for
    a body that is not JSON, or the error ``parse`` raised naming the field."""
    try:
        body = json.loads(await request.body())
    except ValueError:
        return error_response("the request body is not valid JSON", 400, "body")
    except RecursionError:  # (a body nested past the interpreter's recursion limit)
        return error_response("the request body is nested too deep", 400, "body")
    try:
        return parse(body, request.headers.get("x-session-id"))
    except RequestError as e:
        return error_response(str(e), e.status, e.field)


async def _served(
    request: Request,
    running: RunningRequests,
    key: str | None,
    streams: list[TokenStream],
    events: AsyncIterator[bytes] | None,
    abort: Callable[[], None],
    headers: list[tuple[bytes, bytes]] | None = None,
) -> Response | None:
    """A streamed request's response (``events``), known in ``running`` under ``key`` until its
    last event is sent; for a whole answer (``events`` None), None once every stream has ended,
    known there until then, or a 499 when the client left first (its streams aborted)."""
    if events is not None:
        tracked = running.until_sent(key, streams, events)
        return EngineStreamResponse(tracked, abort, headers=headers)  # type: ignore[return-value]
    try:
        if not await until_disconnect(request.receive, _wait_all(streams)):
            abort()
            return Response(status_code=499)
    finally:
        running.remove(key, streams)
    return None


async def _pull_prefix(engine: MockEngine, request: Request, parsed: ParsedRequest) -> bool:
    """The decode side of a hand-off (``kv_transfer_params.do_remote_prefill``): pull the prompt's
    KV from the prefill engine (simulated) before decoding. False if the client went away."""
    transfer = parsed.kv_transfer_params
    if transfer is None or not transfer.get("do_remote_prefill"):
        return True
    prompt = parsed.params.prompt_token_ids
    hashes, cached = engine.prompt_blocks(prompt)
    if not await until_disconnect(
        request.receive, asyncio.sleep(engine.transfer_seconds(len(hashes) - cached))
    ):
        return False
    engine.import_prefix(prompt)
    return True


def _handoff(engine: MockEngine, request: Request, parsed: ParsedRequest, request_id: str) -> dict[str, Any]:
    """The prefill side of a hand-off (``do_remote_decode``): where the KV is, as vLLM's connectors
    say it."""
    hashes, _ = engine.prompt_blocks(parsed.params.prompt_token_ids)
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine.engine_id,
        "remote_block_ids": list(range(len(hashes))),
        "remote_host": request.url.hostname,
        "remote_port": request.url.port,
        "remote_request_id": request_id,
    }


def _submit_choices(engine: MockEngine, parsed: ParsedRequest, request_id: str) -> list[TokenStream]:
    """One engine request per choice. The first keeps the request's own seed (``n=1`` answers as
    it always has); choice ``i`` samples from the seed plus ``i``, so the choices differ."""
    params = parsed.params
    if parsed.n == 1:
        return [engine.submit(params, request_id)]
    seed = engine.config.seed if params.seed is None else params.seed
    return [
        engine.submit(dataclasses.replace(params, seed=seed + i), f"{request_id}-{i}")
        for i in range(parsed.n)
    ]


async def _pieces(stream: TokenStream, text_of: _TokenText) -> AsyncIterator[str]:
    """One answer's text as its tokens come (nothing more once the engine stopped it)."""
    async for batch in stream.deltas():
        if stream.finish_reason == "abort":
            return
        yield text_of(batch)


async def _wait_all(streams: list[TokenStream]) -> None:
    for stream in streams:
        await stream.wait()


async def _interleaved(streams: list[TokenStream]) -> AsyncIterator[tuple[int, list[int], bool]]:
    """``(choice, new tokens, last)`` as the choices' tokens come, whichever choice they are of;
    ``last`` marks a choice's final batch (its stream has finished)."""
    if len(streams) == 1:  # (every request of the benchmarks: no task, no queue per request)
        only = streams[0]
        count = 0
        async for tokens in only.deltas():
            count += len(tokens)
            yield 0, tokens, only.finished and count == len(only.tokens)
        return
    queue: asyncio.Queue[tuple[int, list[int] | None]] = asyncio.Queue()

    async def pump(i: int, stream: TokenStream) -> None:
        async for batch in stream.deltas():
            queue.put_nowait((i, batch))
        queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    seen = [0] * len(streams)
    try:
        running = len(streams)
        while running:
            i, batch = await queue.get()
            if batch is None:
                running -= 1
                continue
            seen[i] += len(batch)
            yield i, batch, streams[i].finished and seen[i] == len(streams[i].tokens)
    finally:
        for task in tasks:
            task.cancel()


async def _sse(
    streams: list[TokenStream], parsed: ParsedRequest, response_id: str, text_of: _TokenText
) -> AsyncIterator[bytes]:
    """vLLM's stream: each event carries one choice (its ``index``); a chat opens every choice
    with its role, then its echo; a completion's echo leads its first text."""
    created = int(time.time())
    chat = parsed.endpoint == "chat"
    head: dict[str, Any] = {
        "id": response_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": parsed.model,
    }
    if parsed.include_usage:
        head["usage"] = None

    def chunk(index: int, text: str, finish_reason: str | None, *, role: bool = False) -> bytes:
        if chat:
            delta = {"role": "assistant", "content": text} if role else {"content": text}
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {
                "index": index,
                "text": text,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
            }
        head["choices"] = [choice]
        return b"data: " + _encode(head) + b"\n\n"

    echo = parsed.echo
    if chat:
        for i in range(parsed.n):
            yield chunk(i, "", None, role=True)
        if echo:
            for i in range(parsed.n):
                yield chunk(i, echo, None)
    to_echo = [bool(echo) and not chat] * parsed.n
    ended = [False] * parsed.n
    async for i, batch, last in _interleaved(streams):
        if last and streams[i].stopped:
            return
        text = text_of(batch)
        if to_echo[i]:
            text = echo + text
            to_echo[i] = False
        ended[i] = last
        yield chunk(i, text, streams[i].finish_reason if last else None)
    if any(stream.stopped for stream in streams):
        return
    for i, stream in enumerate(streams):
        if not ended[i]:  # (aborted by /abort_request after its last tokens were sent)
            yield chunk(i, echo if to_echo[i] else "", stream.finish_reason)
    if parsed.include_usage:
        head["choices"] = []
        head["usage"] = _usage(streams)
        yield b"data: " + _encode(head) + b"\n\n"
    yield _DONE


def _usage(streams: list[TokenStream]) -> dict[str, Any]:
    """One prompt, every choice's output; the cached share is the first choice's, as vLLM's."""
    first = streams[0]
    return usage(first.prompt_tokens, sum(len(s.tokens) for s in streams), first.cached_tokens)


def _full_response(
    streams: list[TokenStream], parsed: ParsedRequest, response_id: str, text_of: _TokenText
) -> dict[str, Any]:
    choices = []
    for i, stream in enumerate(streams):
        text = parsed.echo + text_of(stream.tokens)
        if parsed.endpoint == "chat":
            choice: dict[str, Any] = {
                "index": i,
                "message": {"role": "assistant", "content": text, "tool_calls": []},
                "logprobs": None,
                "finish_reason": stream.finish_reason,
                "stop_reason": None,
            }
        else:
            choice = {
                "index": i,
                "text": text,
                "logprobs": None,
                "finish_reason": stream.finish_reason,
                "stop_reason": None,
            }
        choices.append(choice)
    return {
        "id": response_id,
        "object": "chat.completion" if parsed.endpoint == "chat" else "text_completion",
        "created": int(time.time()),
        "model": parsed.model,
        "choices": choices,
        "usage": _usage(streams),
    }
