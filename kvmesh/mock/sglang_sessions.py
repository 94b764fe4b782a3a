"""SGLang's sessions on the mock engine, as SGLang 0.5.23's server has them: ``/open_session`` and
``/close_session`` (GET or POST), and the ``/generate`` requests naming one in ``session_params``.

``/open_session`` takes ``OpenSessionReqInput``'s fields (``capacity_of_str_len``, an integer, is
required; ``session_id``, ``timeout``, ``streaming``) and answers the session's id, a JSON string
(a fresh hex id when none was asked for); an id still open is refused, 400, as SGLang refuses it.
``/close_session`` takes ``{"session_id"}`` and answers 200 with no body, whether or not the id was
open. A ``/generate`` request naming a session this engine does not have open is refused, 400,
with SGLang's words: a request sent to the wrong engine fails as it does on SGLang.

The session is the engine's session of :class:`~kvmesh.worker.retention.Retention`: the blocks of
its newest turn are kept resident while it is open, as SGLang keeps a session's history (with no
``timeout`` it stays open until closed). What SGLang does with the history itself (a request
continues the text of an earlier one, ``session_params.rid``) is not modelled: the mock serves the
request's own prompt.
"""

from __future__ import annotations

import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvmesh.errors import RequestError
from kvmesh.mock.engine import MockEngine
from kvmesh.router.request.generate_api import closed_session, opened_session
from kvmesh.worker.rpc import error_response, json_object

_NO_TIMEOUT = 10.0 * 365 * 86400
"""A session opened without a timeout stays open until closed (the ledger takes a number)."""


def unknown_session(engine: MockEngine, body: Any) -> str | None:
    """SGLang's refusal of a ``/generate`` request naming a session this engine has not open,
    or None."""
    params = body.get("session_params") if isinstance(body, dict) else None
    if not isinstance(params, dict) or not isinstance(params.get("id"), str):
        return None
    session = params["id"]
    if session in engine.retention.sessions:
        return None
    return f"Invalid request: session id {session} does not exist"


def session_routes(engine: MockEngine) -> list[Route]:
    async def open_session(request: Request) -> Response:
        try:
            body = await json_object(request)
            session = opened_session(body)
        except RequestError as e:
            return error_response(str(e), e.status, e.field)
        session = session or uuid.uuid4().hex
        if session in engine.retention.sessions:
            return error_response(
                "Failed to open the session. Check if a session with the same id is still open.",
                400,
                "session_id",
            )
        timeout = body.get("timeout")
        try:
            engine.open_session(session, float(timeout) if timeout is not None else _NO_TIMEOUT)
        except RequestError as e:  # (past the engine's --max-sessions)
            return error_response(str(e), 400, e.field)
        return JSONResponse(session)

    async def close_session(request: Request) -> Response:
        try:
            session = closed_session(await json_object(request))
        except RequestError as e:
            return error_response(str(e), e.status, e.field)
        engine.close_session(session)
        return Response(status_code=200)

    return [
        Route("/open_session", open_session, methods=["GET", "POST"]),
        Route("/close_session", close_session, methods=["GET", "POST"]),
    ]


__all__ = ["session_routes", "unknown_session"]
