"""``--middleware kvmesh.adapters.vllm.KvMeshMiddleware``: kvmesh's router embedded in ``vllm serve``.

The engine-agnostic :class:`kvmesh.router.asgi.middleware.KvMeshMiddleware` with the vLLM glue that
vLLM's no-argument ``app.add_middleware(cls)`` cannot pass in:

* the tokenizer defaults to the served model's own (``KVMESH_TOKENIZER=engine``), bound to vLLM's
  renderer on the first request;
* a request that belongs to a kvmesh session (``nvext.session_control.session_id``) is tagged with
  vLLM's native ``X-Session-ID`` header before kvmesh strips ``nvext``, so vLLM carries the id into
  the engine core, where kvmesh's session retention sees each turn. The header travels with the
  request when kvmesh forwards it to a peer.

Priority polarity needs no glue here: the middleware rewrites ``nvext.agent_hints.priority`` per
the serving worker's ``/kvmesh/info`` ``priority_polarity`` (``lower_first`` for vLLM with
``--scheduling-policy priority``, so vLLM receives ``-priority``).
"""

from __future__ import annotations

import os
from typing import Any

import msgspec

from kvmesh.adapters.vllm.tokenizer import VllmTokenizer
from kvmesh.router.asgi.middleware import GENERATION_PATHS
from kvmesh.router.asgi.middleware import KvMeshMiddleware as _CoreMiddleware
from kvmesh.router.mesh.settings import MeshSettings

SESSION_HEADER = b"x-session-id"
_SESSION_MARK = b'"session_control"'


class KvMeshMiddleware(_CoreMiddleware):
    """kvmesh's routing middleware for ``vllm serve --middleware`` (no constructor arguments)."""

    def __init__(self, app: Any, *, settings: MeshSettings | None = None) -> None:
        if settings is None:
            settings = MeshSettings.load()
            if "KVMESH_TOKENIZER" not in os.environ and "tokenizer" not in _config_file_keys():
                settings = settings.replace(tokenizer="engine")
        self.engine_tokenizer = VllmTokenizer()
        super().__init__(app, settings=settings, tokenizer=self.engine_tokenizer)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            if not self.engine_tokenizer.bound and "app" in scope:
                self.engine_tokenizer.bind_from_app(scope["app"])
            if scope["path"] in GENERATION_PATHS and scope["method"] == "POST":
                scope, receive = await _tag_session(scope, receive, self.settings.max_body_bytes)
        await super().__call__(scope, receive, send)


def _config_file_keys() -> set[str]:
    """Top-level keys of the KVMESH_CONFIG file, if any (a tokenizer named there wins too).
    MeshSettings.load() has already read and validated the file."""
    path = os.environ.get("KVMESH_CONFIG")
    if not path:
        return set()
    import tomllib  # KVMESH_CONFIG already requires Python 3.11+

    with open(path, "rb") as f:
        return set(tomllib.load(f))


async def _tag_session(scope: dict[str, Any], receive: Any, limit: int) -> tuple[dict[str, Any], Any]:
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
