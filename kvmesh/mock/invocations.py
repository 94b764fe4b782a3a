"""The mock's SageMaker entry point, ``POST /invocations``, as vLLM 0.33 serves it with stateful
sessions on (``SAGEMAKER_ENABLE_STATEFUL_SESSIONS=true``).

* A body is served as the first request it is: a chat request (``messages``), a completion
  (``prompt``), an embedding request (``input``); anything else is a 400 naming ``body``. (vLLM
  tries its pooling types only on a pooling model; on a generating one a body that is neither chat
  nor completion is its 400 naming ``prompt``. The mock serves both kinds, so it tries them last.)
* ``{"requestType": "NEW_SESSION"}`` opens a session: 200, its id in
  ``X-Amzn-SageMaker-New-Session-Id`` as ``<id>; Expires=<UTC time>``, twenty minutes ahead.
  ``{"requestType": "CLOSE"}`` with the session's id in ``X-Amzn-SageMaker-Session-Id`` closes it:
  200, its id in ``X-Amzn-SageMaker-Closed-Session-Id``.
* A request naming a session this engine does not hold (never opened here, closed or expired) is a
  400 naming the header, whatever its body: the session's state lives in one engine's memory.
* The body's ``model`` is replaced by the adapter ``X-Amzn-SageMaker-Adapter-Identifier`` names,
  or, without the header, by none, so the served model answers (vLLM's SageMaker handling writes
  the header's value, or null, there). The mock serves no adapter: one named is its 404.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from kvmesh.router.request.invocations import (
    ADAPTER_HEADER,
    CLOSED_SESSION_HEADER,
    NEW_SESSION_HEADER,
    SESSION_HEADER,
)
from kvmesh.worker.rpc import error_response

SESSION_TTL_S = 1200.0
"""How long a session lives (the SageMaker session manager's default: twenty minutes)."""

Handler = Callable[[Request], Awaitable[Response]]


def invocations_handler(chat: Handler, completions: Handler, embeddings: Handler) -> Handler:
    """The ``/invocations`` endpoint over the mock's own handlers (see the module docstring)."""
    sessions: dict[str, float] = {}  # session id -> when it expires (time.time())

    async def invocations(request: Request) -> Response:
        try:
            body = json.loads(await request.body())  # (cached: the handler reads it again)
        except (ValueError, RecursionError):
            return error_response("the request body is not valid JSON", 400, "body")
        if not isinstance(body, dict):
            return error_response("the request body must be a JSON object", 400, "body")
        now = time.time()
        for expired in [s for s, until in sessions.items() if until <= now]:
            del sessions[expired]
        header = SESSION_HEADER.decode()
        session = request.headers.get(header)
        if session is not None and session not in sessions:
            return error_response(f"Bad request: session {session!r} not found", 400, header)
        kind = body.get("requestType")
        if kind == "NEW_SESSION":
            opened = uuid.uuid4().hex
            sessions[opened] = now + SESSION_TTL_S
            expires = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now + SESSION_TTL_S))
            headers = {NEW_SESSION_HEADER.decode(): f"{opened}; Expires={expires}"}
            return Response(f"Session {opened} created", headers=headers)
        if kind == "CLOSE":
            if session is None:
                return error_response("CLOSE names no session", 400, header)
            del sessions[session]
            return Response(f"Session {session} closed", headers={CLOSED_SESSION_HEADER.decode(): session})
        if kind is not None:
            return error_response("requestType must be NEW_SESSION or CLOSE", 400, "requestType")
        for field, handler in (("messages", chat), ("prompt", completions), ("input", embeddings)):
            if field in body:
                # (vLLM's SageMaker handling: the adapter header's value is the model, and without
                # the header none is, so the served model answers whatever the body named)
                adapter = request.headers.get(ADAPTER_HEADER.decode())
                body = {k: v for k, v in body.items() if k != "model"}
                if adapter is not None:
                    body["model"] = adapter
                request._body = json.dumps(body).encode()  # (what the handler reads)
                return await handler(request)
        return error_response(
            "no handler fits the body: it has none of messages, prompt or input", 400, "body"
        )

    return invocations


__all__ = ["SESSION_TTL_S", "invocations_handler"]
