"""The router, in layer folders (imports only go down): ``core/`` (pure routing) < ``request/``
(pure parsing and tokenization) < ``upstream/`` (the HTTP/1.1 client towards workers) < ``mesh/``
(the fleet runtime) < ``asgi/`` (the middleware, the admin endpoints, the standalone app).
docs/ARCHITECTURE.md draws them and one request's path through them.

``kvmesh.router.KvMeshMiddleware`` is the engine-agnostic middleware for any ASGI app, the simulated
engine and the standalone router. Inside an engine, mount that engine's subclass instead (``vllm
serve --middleware kvmesh.adapters.vllm.KvMeshMiddleware``), which hashes with the engine's own
tokenizer. It is imported lazily, so the pure core can be used without the HTTP stack.
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
