"""kvmesh's routing middleware as mounted on trtllm-serve's app.

The engine-agnostic :class:`kvmesh.router.KvMeshMiddleware` (configured from ``KVMESH_*`` /
``KVMESH_CONFIG``, like every embedded router) plus one piece of glue: a request that belongs to a
kvmesh session (``nvext.session_control.session_id``) gets an ``x-session-id`` header before the
router strips ``nvext``, so the hints layer inside (:mod:`.hints`) can show the turn to the
session's retention. The header travels with the request when kvmesh forwards it to a peer.
The tagging is the vLLM adapter's own helper: both engines learn the session the same way.
"""

from __future__ import annotations

from typing import Any

from kvmesh.adapters.session_tag import tag_session
from kvmesh.router import KvMeshMiddleware as _CoreMiddleware
from kvmesh.router import MeshSettings

GENERATION_PATHS = frozenset(("/v1/chat/completions", "/v1/completions"))


class KvMeshMiddleware(_CoreMiddleware):  # type: ignore[misc, valid-type]
    """kvmesh's router for trtllm-serve (added by :mod:`.server` with no arguments)."""

    def __init__(self, app: Any, *, settings: MeshSettings | None = None) -> None:
        super().__init__(app, settings=settings)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] in GENERATION_PATHS and scope["method"] == "POST":
            scope, receive = await tag_session(scope, receive, self.settings.max_body_bytes)
        await super().__call__(scope, receive, send)
