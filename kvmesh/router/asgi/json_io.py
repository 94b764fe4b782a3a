"""JSON over raw ASGI, as the routing path speaks it: a request body read up to a size limit, and
answers that are a JSON document or an OpenAI-style error (:func:`kvmesh._http.error_body`)."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from kvmesh._http import error_body
from kvmesh.errors import RequestError
from kvmesh.router.request.parse import decode_body

__all__ = ["read_body", "read_body_or_refuse", "read_json_body", "send_error", "send_json"]

_encode = msgspec.json.encode
_timeout = getattr(asyncio, "timeout", None)  # Python 3.11+
_CONTENT_TYPE = (b"content-type", b"application/json")


async def read_json_body(
    scope: dict[str, Any], receive: Any, limit: int, timeout: float | None
) -> bytes | None:
    """:func:`read_body`, then checked as a JSON object no deeper than a generation request may
    be (RequestError(400) naming ``body``: an engine's own parser can fail on it with a 500), for
    a body relayed unread; None if the client left."""
    body = await read_body(scope, receive, limit, timeout)
    if body is not None:
        decode_body(body)
    return body


async def read_body(
    scope: dict[str, Any], receive: Any, limit: int, timeout: float | None = None
) -> bytes | None:
    """The request body, or None if the client left; RequestError(413) past ``limit`` bytes
    (before reading when ``content-length`` declares more), RequestError(400) for a
    ``content-length`` that is not a number, RequestError(408) when the whole body has not
    arrived within ``timeout`` seconds (a client that stalls after the head holds a slot)."""
    if timeout is None:
        return await _read_body(scope, receive, limit)
    try:
        if _timeout is not None:
            # In this task: ``wait_for`` (3.10) reads in a task of its own, which starts only after
            # everything already scheduled, so a burst's requests queued behind one another.
            async with _timeout(timeout):
                return await _read_body(scope, receive, limit)
        return await asyncio.wait_for(_read_body(scope, receive, limit), timeout)
    except asyncio.TimeoutError:
        raise RequestError(
            f"request body not received within {timeout:g}s", field="body", status=408
        ) from None


async def read_body_or_refuse(
    scope: dict[str, Any], receive: Any, send: Any, limit: int, timeout: float | None
) -> bytes | None:
    """:func:`read_body`, its refusal sent as the answer: None when there is nothing more to do
    (the body was refused, or the client left)."""
    try:
        return await read_body(scope, receive, limit, timeout)
    except RequestError as e:
        await send_error(send, e.status, str(e), e.field)
        return None


async def _read_body(scope: dict[str, Any], receive: Any, limit: int) -> bytes | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                declared = int(value)
            except ValueError:
                raise RequestError("invalid content-length header", field="content-length") from None
            if declared < 0:
                raise RequestError("invalid content-length header", field="content-length")
            if declared > limit:
                raise RequestError(f"request body larger than {limit} bytes", field="body", status=413)
            break
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise RequestError(f"request body larger than {limit} bytes", field="body", status=413)
            parts.append(chunk)
        if not message.get("more_body", False):
            return parts[0] if len(parts) == 1 else b"".join(parts)


async def send_json(
    send: Any, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    """Answer with ``body``, an encoded JSON document, and any extra ``headers``."""
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [_CONTENT_TYPE, (b"content-length", str(len(body)).encode()), *(headers or ())],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_error(
    send: Any,
    status: int,
    message: str,
    field: str | None = None,
    *,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    """Answer with an OpenAI-style error whose ``param`` names the offending field."""
    await send_json(send, status, _encode(error_body(message, status, field)), headers)
