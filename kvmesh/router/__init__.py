"""The router: pure routing core, ASGI middleware and the standalone router app.

``kvmesh.router.KvMeshMiddleware`` is what engines load (``vllm serve --middleware
kvmesh.router.KvMeshMiddleware``); it is imported lazily so that the pure routing core can be used
without pulling in the HTTP stack.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvmesh.router.asgi.middleware import KvMeshMiddleware
    from kvmesh.router.mesh.settings import MeshSettings

__all__ = ["KvMeshMiddleware", "MeshSettings"]


def __getattr__(name: str) -> Any:
    if name == "KvMeshMiddleware":
        from kvmesh.router.asgi.middleware import KvMeshMiddleware

        return KvMeshMiddleware
    if name == "MeshSettings":
        from kvmesh.router.mesh.settings import MeshSettings

        return MeshSettings
    raise AttributeError(f"module 'kvmesh.router' has no attribute {name!r}")
