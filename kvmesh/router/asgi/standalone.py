"""The standalone router: KvMeshMiddleware in front of an app with no local engine.

Besides what the middleware answers (the generation endpoints, ``/kvmesh/workers``,
``/busy_threshold``) it serves ``GET /health`` (503 while no worker is routable), ``GET /v1/models``
(the models the fleet's workers reported) and ``GET /metrics`` (prometheus-client's registry).
"""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvmesh.router.asgi.middleware import KvMeshMiddleware
from kvmesh.router.mesh.metrics import CONTENT_TYPE, render
from kvmesh.router.mesh.settings import MeshSettings
from kvmesh.router.request.tokenizer import Tokenizer


def build_router_app(settings: MeshSettings, *, tokenizer: Tokenizer | None = None) -> KvMeshMiddleware:
    """The standalone router ASGI app for ``settings.workers`` (any self URL is ignored)."""
    settings = settings.replace(self_url=None, self_worker_id=None)
    middleware: KvMeshMiddleware

    async def health(request: Request) -> Response:
        mesh = middleware.mesh
        await mesh.ensure_started()
        await mesh.wait_ready()
        up = len(mesh.registry.routable)
        body = {
            "status": "ok" if up else "no workers",
            "workers_up": up,
            "workers": len(mesh.registry.workers),
        }
        return JSONResponse(body, status_code=200 if up else 503)

    async def models(request: Request) -> Response:
        mesh = middleware.mesh
        await mesh.ensure_started()
        await mesh.wait_ready()
        data = [{"id": m, "object": "model", "owned_by": "kvmesh"} for m in mesh.registry.models]
        return JSONResponse({"object": "list", "data": data})

    async def metrics(request: Request) -> Response:
        return Response(render(), media_type=CONTENT_TYPE)

    inner = Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ]
    )
    middleware = KvMeshMiddleware(inner, settings=settings, tokenizer=tokenizer)
    return middleware
