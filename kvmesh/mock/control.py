"""The engine-control endpoints an RL loop calls around a weight update, on the mock: vLLM 0.33's
(served with ``VLLM_SERVER_DEV_MODE=1``) and SGLang 0.5.23's. What each does to the engine is
:mod:`kvmesh.mock.pause`'s.

    POST /pause?mode=abort|wait|keep&clear_cache=true|false  {"status": "paused"}
    POST /resume                                              {"status": "resumed"}
    GET  /is_paused                                           {"is_paused": bool}
    POST /sleep?level=0|1|2&mode=abort|wait|keep              {"status": "sleeping", "level": level}
    POST /wake_up[?tags=weights&tags=kv_cache]                {"status": "awake" (or "sleeping"),
                                                               "tags": the tags given, or null}
    GET  /is_sleeping                                         {"is_sleeping": bool}
    POST /pause_generation {"mode": "abort"|"retract"|"in_place"}   SGLang's: {"message": ...,
    POST /continue_generation {}                                    "status": "ok"}
    GET  /ready                                               SGLang's: 200, or 503 while paused

vLLM reads its arguments from the query string (defaults ``mode=abort``, ``clear_cache=true``,
``level=1``; a boolean as pydantic reads one: ``true``/``false``, ``1``/``0``, ``yes``/``no``,
``on``/``off``...) and answers a bad one 400, its ``param`` the query field (``query.mode``), as
its validation handler does. SGLang reads a JSON object (its other fields are taken and change
nothing); a body that is missing, not JSON or not an object is a 400 naming ``body``, a bad mode a
400 naming ``mode``. A pause or sleep is answered once it is complete (``wait``: once the running
requests have drained). The paths take no token, as the engines' own.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvmesh.errors import RequestError
from kvmesh.mock.engine import MockEngine
from kvmesh.mock.pause import PAUSE_MODES, SGLANG_PAUSE_MODES, SLEEP_LEVELS, GenerationPaused
from kvmesh.router.request.parse import decode_body
from kvmesh.worker.rpc import error_response

Handler = Callable[[Request], Awaitable[Response]]

_TRUE = frozenset({"1", "true", "t", "yes", "y", "on"})
_FALSE = frozenset({"0", "false", "f", "no", "n", "off"})
_INTEGER = re.compile(r"[+-]?[0-9]+")
_CACHE_KEPT = (
    "the prefix cache could not be emptied: pinned prefixes or open sessions hold blocks of it "
    "(the engine is paused)"
)


def answers_paused(handler: Handler) -> Handler:
    """``handler``, answering the refusal of a request the paused engine refuses (every route that
    submits to the engine has it, so a batch's prompt is refused as a single request is): a 503,
    or, for a streamed chat request or completion, what vLLM 0.33 streams then, a 200 whose first
    event is the error (code 503) and then ``[DONE]``."""

    @functools.wraps(handler)
    async def serve(request: Request) -> Response:
        try:
            return await handler(request)
        except GenerationPaused as e:
            if request.url.path in _STREAMS_ITS_REFUSAL and await _streamed(request):
                error = {"message": str(e), "type": "InternalServerError", "param": None, "code": e.status}
                event = b"data: " + json.dumps({"error": error}).encode() + b"\n\ndata: [DONE]\n\n"
                return Response(event, media_type="text/event-stream")
            return error_response(str(e), e.status)

    return serve


_STREAMS_ITS_REFUSAL = frozenset(("/v1/chat/completions", "/v1/completions", "/invocations"))
"""The paths where vLLM refuses a streamed request inside its stream (its chat and completion
handlers turn the engine's retryable error into the stream's first event)."""


async def _streamed(request: Request) -> bool:
    try:
        body = json.loads(await request.body())  # (cached: the handler has read it)
    except (ValueError, RecursionError):
        return False
    return isinstance(body, dict) and body.get("stream") is True


def control_routes(engine: MockEngine) -> list[Route]:
    control = engine.control

    async def pause(request: Request) -> Response:
        query = request.query_params
        mode = _choice(query.get("mode"), "mode", PAUSE_MODES, "abort")
        clear_cache = _flag(query.get("clear_cache"), "clear_cache", default=True)
        if not await control.pause(mode, clear_cache=clear_cache):
            return error_response(_CACHE_KEPT, 500)
        return JSONResponse({"status": "paused"})

    async def resume(request: Request) -> Response:
        control.resume()
        return JSONResponse({"status": "resumed"})

    async def is_paused(request: Request) -> Response:
        return JSONResponse({"is_paused": control.paused})

    async def sleep(request: Request) -> Response:
        query = request.query_params
        level = _level(query.get("level"))
        mode = _choice(query.get("mode"), "mode", PAUSE_MODES, "abort")
        if not await control.sleep(level, mode):
            return error_response(_CACHE_KEPT, 500)
        return JSONResponse({"status": "sleeping", "level": level})

    async def wake_up(request: Request) -> Response:
        tags = request.query_params.getlist("tags") or None
        awake = control.wake_up(tags)
        return JSONResponse({"status": "awake" if awake else "sleeping", "tags": tags})

    async def is_sleeping(request: Request) -> Response:
        return JSONResponse({"is_sleeping": control.sleeping})

    async def pause_generation(request: Request) -> Response:
        body = await _json_object(request)
        mode = _choice(body.get("mode"), "mode", SGLANG_PAUSE_MODES, "abort", in_query=False)
        await control.pause_generation(mode)
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    async def ready(request: Request) -> Response:
        return Response(status_code=503 if control.generation_paused else 200)

    async def continue_generation(request: Request) -> Response:
        await _json_object(request)
        control.resume()
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    return [
        Route("/pause", _refusing_bad_arguments(pause), methods=["POST"]),
        Route("/resume", resume, methods=["POST"]),
        Route("/is_paused", is_paused, methods=["GET"]),
        Route("/sleep", _refusing_bad_arguments(sleep), methods=["POST"]),
        Route("/wake_up", wake_up, methods=["POST"]),
        Route("/is_sleeping", is_sleeping, methods=["GET"]),
        Route("/pause_generation", _refusing_bad_arguments(pause_generation), methods=["POST"]),
        Route("/continue_generation", _refusing_bad_arguments(continue_generation), methods=["POST"]),
        Route("/ready", ready, methods=["GET"]),
    ]


def _refusing_bad_arguments(handler: Handler) -> Handler:
    @functools.wraps(handler)
    async def serve(request: Request) -> Response:
        try:
            return await handler(request)
        except RequestError as e:
            return error_response(str(e), e.status, e.field)

    return serve


def _choice(
    value: object, name: str, choices: tuple[str, ...], default: str, *, in_query: bool = True
) -> str:
    if value is None:
        return default
    if value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        raise RequestError(f"{name} must be one of {allowed}, got {value!r}", field=_param(name, in_query))
    return value  # type: ignore[return-value]


def _flag(value: str | None, name: str, *, default: bool) -> bool:
    if value is None:
        return default
    word = value.strip().lower()
    if word in _TRUE or word in _FALSE:
        return word in _TRUE
    raise RequestError(f"{name} must be a boolean (true or false), got {value!r}", field=_param(name))


def _level(value: str | None) -> int:
    if value is None:
        return 1
    text = value.strip()
    level = int(text) if _INTEGER.fullmatch(text) else None
    if level not in SLEEP_LEVELS:
        raise RequestError(f"level must be an integer from 0 to 2, got {value!r}", field=_param("level"))
    return level  # type: ignore[return-value]


def _param(name: str, in_query: bool = True) -> str:
    """The field an error names: vLLM's validation handler names a query argument by its place."""
    return f"query.{name}" if in_query else name


async def _json_object(request: Request) -> dict[str, Any]:
    """SGLang's request object (FastAPI requires the body, and an object): the router's own
    reading of a body (``decode_body``: a JSON object, or a 400 naming ``body``)."""
    raw = await request.body()
    if not raw.strip():
        raise RequestError("the request body is required (a JSON object, {} for the defaults)", field="body")
    return decode_body(raw)
