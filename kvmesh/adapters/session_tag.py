"""Tag a request that belongs to a kvmesh session with the engine-native ``X-Session-ID`` header.

vLLM carries that header into the engine core (and the TensorRT-LLM adapter reads it for its
retention pins), so the engine can tell a session's turns apart after kvmesh strips ``nvext``.
Shared engine glue for the adapters whose engines key sessions by that header; the body is replayed
unchanged.
"""

from __future__ import annotations

from typing import Any

import msgspec

SESSION_HEADER = b"x-session-id"
_SESSION_MARK = b'"session_control"'


async def tag_session(scope: dict[str, Any], receive: Any, limit: int) -> tuple[dict[str, Any], Any]:
    """Add ``X-Session-ID`` from ``nvext.session_control``; the body is replayed unchanged."""
    headers = scope["headers"]
    declared = None
    for name, value in headers:
        if name == SESSION_HEADER:
            return scope, receive  # the client named the session itself
        if name == b"content-length":
            declared = value
    if declared is None or not declared.isdigit() or int(declared) > limit:
        return scope, receive  # streamed or oversized bodies: leave them to kvmesh's own checks
    messages: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    body = b"".join(chunks)
    session_id = _session_id(body) if _SESSION_MARK in body else None
    if session_id is not None:
        scope = {**scope, "headers": [*headers, (SESSION_HEADER, session_id.encode("latin-1"))]}
    pending = iter(messages)

    async def replay() -> dict[str, Any]:
        for message in pending:
            return message
        return await receive()  # type: ignore[no-any-return]

    return scope, replay


def _session_id(body: bytes) -> str | None:
    try:
        doc = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return None  # kvmesh answers the malformed body itself
    nvext = doc.get("nvext") if isinstance(doc, dict) else None
    control = nvext.get("session_control") if isinstance(nvext, dict) else None
    session_id = control.get("session_id") if isinstance(control, dict) else None
    if isinstance(session_id, str) and session_id and session_id.isascii() and session_id.isprintable():
        return session_id
    return None
