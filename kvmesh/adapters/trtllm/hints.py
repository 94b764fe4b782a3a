"""Per-request hints that trtllm-serve's OpenAI handlers cannot carry: priority and session.

trtllm-serve's chat and completion handlers call ``generator.generate_async(...)`` with a fixed
set of arguments; no version passes a request priority or anything kvmesh could tag a session
with. So the hints travel beside the request instead of inside it:

1. :class:`RequestHintsMiddleware` (pure ASGI, inside kvmesh's routing middleware, outside the
   FastAPI routes) takes ``priority`` out of the JSON body kvmesh's router hands the engine (the
   router writes it there for a worker whose ``priority_polarity`` is ``higher_first``) and the
   ``x-session-id`` header, and puts them in context variables for the rest of the request;
2. :func:`wrap_generate_async` replaces the LLM object's ``generate_async`` (an instance attribute)
   with one that reads them: the priority becomes TensorRT-LLM's own ``priority`` argument where
   the installed ``generate_async`` has one, and the session's turn is shown to the retention
   ledger (:mod:`.retention`) so the conversation's prefix stays pinned.

Context variables cross from the middleware into the handler because Starlette runs the route in
the same task (or a task copied from its context).

Priority scale: kvmesh's ``agent_hints.priority`` is any number, higher = more important;
TensorRT-LLM's is a float in [0, 1], higher = sooner, 0.5 by default. ``0.5 + atan(p) / pi`` maps
one onto the other: strictly increasing (the order of any two priorities is kept, far beyond what
a logistic curve keeps in a double), 0 -> 0.5 (the engine's default), never reaching 0 or 1.
"""

from __future__ import annotations

import contextvars
import inspect
import json
import math
from collections.abc import Callable
from typing import Any

from kvmesh._http import route_path

__all__ = [
    "RequestHintsMiddleware",
    "engine_priority",
    "has_priority_parameter",
    "wrap_generate_async",
]

PRIORITY: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "kvmesh_trtllm_priority", default=None
)
SESSION: contextvars.ContextVar[str | None] = contextvars.ContextVar("kvmesh_trtllm_session", default=None)

# (trtllm-serve's /v1/responses handler calls generate_async as its chat handler does)
GENERATION_PATHS = frozenset(("/v1/chat/completions", "/v1/completions", "/v1/responses"))
SESSION_HEADER = b"x-session-id"
_PRIORITY_MARK = b'"priority"'


def engine_priority(priority: float) -> float:
    """kvmesh's priority (any real, higher = more important) on TensorRT-LLM's (0, 1) scale."""
    return 0.5 + math.atan(priority) / math.pi


def has_priority_parameter(generate_async: Callable[..., Any]) -> bool:
    """Whether this ``generate_async`` accepts ``priority=`` (TensorRT-LLM's newer LLM API)."""
    try:
        params = inspect.signature(generate_async).parameters
    except (TypeError, ValueError):
        return False
    return "priority" in params


class RequestHintsMiddleware:
    """Moves ``priority`` (body) and ``x-session-id`` (header) of generation requests into
    context variables; the body reaches trtllm-serve without the ``priority`` key."""

    def __init__(self, app: Any, *, max_body_bytes: int = 32 * 1024 * 1024) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or route_path(scope) not in GENERATION_PATHS or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        session = None
        for name, value in scope["headers"]:
            if name == SESSION_HEADER:
                session = value.decode("latin-1")
        session_token = SESSION.set(session)
        priority_token = PRIORITY.set(None)
        try:
            scope, receive = await self._take_priority(scope, receive)
            await self.app(scope, receive, send)
        finally:
            PRIORITY.reset(priority_token)
            SESSION.reset(session_token)

    async def _take_priority(self, scope: dict[str, Any], receive: Any) -> tuple[dict[str, Any], Any]:
        messages: list[dict[str, Any]] = []
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            chunks.append(chunk)
            if size > self.max_body_bytes or not message.get("more_body", False):
                break
        body = b"".join(chunks)
        complete = messages[-1].get("type") == "http.request" and not messages[-1].get("more_body", False)
        if complete and _PRIORITY_MARK in body:
            try:
                doc = json.loads(body)
            except ValueError:
                doc = None  # trtllm-serve answers the malformed body itself
            value = doc.get("priority") if isinstance(doc, dict) else None
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                PRIORITY.set(float(value))
                del doc["priority"]  # type: ignore[union-attr]
                body = json.dumps(doc).encode()
                headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
                headers.append((b"content-length", str(len(body)).encode()))
                scope = {**scope, "headers": headers}
                messages = [{"type": "http.request", "body": body, "more_body": False}]
        pending = iter(messages)

        async def replay() -> dict[str, Any]:
            for message in pending:
                return message
            return await receive()  # type: ignore[no-any-return]

        return scope, replay


def wrap_generate_async(
    llm: Any,
    *,
    pass_priority: bool,
    on_session_turn: Callable[[str, Any], None] | None = None,
) -> Callable[..., Any]:
    """Install (on the ``llm`` instance) a ``generate_async`` that applies the request hints;
    returns the engine's original bound method for kvmesh's own requests."""
    original: Callable[..., Any] = llm.generate_async

    def generate_async(*args: Any, **kwargs: Any) -> Any:
        priority = PRIORITY.get()
        if pass_priority and priority is not None and "priority" not in kwargs:
            kwargs["priority"] = engine_priority(priority)
        result = original(*args, **kwargs)
        session = SESSION.get()
        if session is not None and on_session_turn is not None:
            on_session_turn(session, result)
        return result

    generate_async.__kvmesh_original__ = original  # type: ignore[attr-defined]
    generate_async.__wrapped__ = original  # type: ignore[attr-defined]
    llm.generate_async = generate_async
    return original
