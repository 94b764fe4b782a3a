"""kvmesh's routing middleware as mounted on trtllm-serve's app.

The engine-agnostic :class:`kvmesh.router.KvMeshMiddleware`, configured from ``KVMESH_*`` /
``KVMESH_CONFIG`` like every embedded router. A turn of a kvmesh session
(``nvext.session_control.session_id``) reaches the hints layer inside (:mod:`.hints`) with an
``x-session-id`` header that the router's own forwarding adds on every path (served here or
forwarded to a peer), so the session's retention sees each turn without glue here.
"""

from __future__ import annotations

from typing import Any

from kvmesh.router import KvMeshMiddleware as _CoreMiddleware
from kvmesh.router import MeshSettings


class KvMeshMiddleware(_CoreMiddleware):  # type: ignore[misc, valid-type]
    """kvmesh's router for trtllm-serve (added by :mod:`.server` with no arguments)."""

    def __init__(self, app: Any, *, settings: MeshSettings | None = None) -> None:
        super().__init__(app, settings=settings)
