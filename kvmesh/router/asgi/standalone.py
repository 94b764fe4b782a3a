"""The standalone router: KvMeshMiddleware in front of an app with no local engine.

Besides what the middleware answers (the generation endpoints, SGLang's ``/generate`` and vLLM's
token API among them, ``/kvmesh/workers``, ``/busy_threshold``) it serves ``GET /health`` (503
while no worker is routable; ``/ping`` too, as vLLM names it, ``/readiness``, as sglang-router
does, and ``/ready`` and ``/readyz``, SGLang's and vLLM's readiness probes), ``GET /live`` and
``/liveness`` (200 while the process serves: the liveness probes of Dynamo's frontend and
sglang-router), ``GET /v1/models`` (the models the fleet's workers reported;
``GET /v1/models/{model}``, one of them),
``GET /metrics`` (prometheus-client's registry), the engines' utility endpoints that any worker
answers alike (``/v1/messages/count_tokens``, ``/tokenize``, ``/detokenize``, SGLang's
``/get_model_info`` and more: :mod:`.any_worker`), the pooling requests of an embedding or
reranking fleet (``/v1/embeddings``, ``/v1/rerank``, ``/classify`` and their kin, sent to the
least loaded worker: :mod:`.pooling`), a flush of every worker's prefix cache
(``/flush_cache``, ``/reset_prefix_cache``: :mod:`.flush`), and the engines' controls for a
training loop, sent to every worker (``/pause``, ``/resume``, ``/sleep``, ``/wake_up``, SGLang's
``/pause_generation`` and more: :mod:`.fleet_control`).

A router process of its own (``kvmesh router``) freezes its heap once its workers are known: the
objects of its start-up (its imports, the app, the registry, the workers' info), some 50,000 of them,
move to the collector's permanent generation, as vLLM's API server does with its own. Left where
they are, a full collection walks them all (13-17 ms on the 2-core machine of docs/BENCHMARKS.md),
inside whichever request triggered it; in the routing-quality suite the first request did, and its
parse took 21 ms longer than the next one's.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvmesh._http import error_body
from kvmesh.router.asgi import fleet_control
from kvmesh.router.asgi.any_worker import PATHS as ANY_WORKER_PATHS
from kvmesh.router.asgi.any_worker import READ_PATHS as ANY_WORKER_READS
from kvmesh.router.asgi.any_worker import AnyWorker
from kvmesh.router.asgi.fleet_control import FleetControl
from kvmesh.router.asgi.flush import PATHS as FLUSH_PATHS
from kvmesh.router.asgi.flush import FlushEveryWorker
from kvmesh.router.asgi.middleware import EVERY_PATH, KvMeshMiddleware
from kvmesh.router.asgi.pooling import PATHS as POOLING_PATHS
from kvmesh.router.asgi.pooling import PUT_PATHS as POOLING_PUTS
from kvmesh.router.asgi.pooling import PoolingRelay
from kvmesh.router.asgi.sglang_sessions import PATHS as SESSION_PATHS
from kvmesh.router.asgi.sglang_sessions import SglangSessions
from kvmesh.router.mesh.metrics import CONTENT_TYPE, render
from kvmesh.router.mesh.runtime import Mesh
from kvmesh.router.mesh.settings import MeshSettings
from kvmesh.router.request.invocations import INVOCATIONS_PATH
from kvmesh.router.request.ollama_api import ollama_route
from kvmesh.router.request.tokenizer import Tokenizer


def freeze_startup_heap() -> int:
    """Collect what start-up left behind, then exempt every live object from later collections
    (``gc.freeze``); returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


async def _freeze_when_ready(mesh: Mesh) -> None:
    await mesh.registry.ready.wait()  # the first discovery is over: the workers' info is start-up too
    freeze_startup_heap()


def build_router_app(
    settings: MeshSettings, *, tokenizer: Tokenizer | None = None, freeze_heap: bool = False
) -> KvMeshMiddleware:
    """The standalone router ASGI app for ``settings.workers`` (any self URL is ignored).

    ``freeze_heap``: freeze the process's heap once the first discovery of the workers is over
    (:func:`freeze_startup_heap`). For a process that is only this router (``kvmesh router``); an
    app served beside others in one process (a test run) leaves the collector alone.
    """
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
            "event_plane": mesh.event_plane_status(),
        }
        return JSONResponse(body, status_code=200 if up else 503)

    async def live(request: Request) -> Response:
        # (a liveness probe: this process serves, whatever its workers do; /health is readiness)
        return JSONResponse({"status": "live"})

    async def models(request: Request) -> Response:
        mesh = middleware.mesh
        await mesh.ensure_started()
        await mesh.wait_ready()
        data = [{"id": m, "object": "model", "owned_by": "kvmesh"} for m in mesh.registry.models]
        return JSONResponse({"object": "list", "data": data})

    async def model(request: Request) -> Response:
        # (OpenAI's models.retrieve: one model of the list, or the 404 naming it)
        mesh = middleware.mesh
        await mesh.ensure_started()
        await mesh.wait_ready()
        name = request.path_params["model"]
        if name not in mesh.registry.models:
            return JSONResponse(
                error_body(f"the model {name!r} does not exist on this fleet", 404, "model"), status_code=404
            )
        return JSONResponse({"id": name, "object": "model", "owned_by": "kvmesh"})

    async def metrics(request: Request) -> Response:
        return Response(render(), media_type=CONTENT_TYPE)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        task = asyncio.create_task(_freeze_when_ready(middleware.mesh)) if freeze_heap else None
        try:
            yield
        finally:
            if task is not None:
                task.cancel()

    any_worker = AnyWorker(lambda: middleware.mesh)
    flush = FlushEveryWorker(lambda: middleware.mesh)
    pooling = PoolingRelay(lambda: middleware.mesh)
    control = FleetControl(lambda: middleware.mesh)
    sessions = SglangSessions(lambda: middleware.mesh)
    inner = Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/ping", health, methods=["GET", "POST"]),  # (vLLM's name for it, GET or POST)
            Route("/readiness", health, methods=["GET"]),  # (sglang-router's name for it)
            # (SGLang's readiness probe, and the two names of vLLM's data-parallel supervisor's)
            Route("/ready", health, methods=["GET"]),
            Route("/readyz", health, methods=["GET"]),
            # (the liveness probes of Dynamo's frontend and of sglang-router, by their names)
            Route("/live", live, methods=["GET"]),
            Route("/liveness", live, methods=["GET"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/models/{model:path}", model, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            # (Ollama's model list and description where SGLang's variables move them)
            *(
                Route(ollama_route(path, os.environ), any_worker, methods=["POST"])
                for path in ANY_WORKER_PATHS
            ),
            *(
                Route(ollama_route(path, os.environ), any_worker, methods=["GET"])
                for path in ANY_WORKER_READS
            ),
            *(
                Route(path, pooling, methods=["POST", "PUT"] if path in POOLING_PUTS else ["POST"])
                for path in POOLING_PATHS
            ),
            # (SageMaker's entry point, when its body is no generation: the middleware routes those)
            Route(INVOCATIONS_PATH, pooling, methods=["POST"]),
            # (SGLang takes GET on /flush_cache too)
            *(
                Route(path, flush.serve, methods=["POST", "GET"] if path == "/flush_cache" else ["POST"])
                for path in FLUSH_PATHS
            ),
            *(Route(path, control, methods=["POST"]) for path in fleet_control.POSTS),
            *(Route(path, control, methods=["GET"]) for path in fleet_control.GETS),
            *(Route(path, control, methods=["GET", "POST"]) for path in fleet_control.EITHER),
            *(
                Route(path, control, methods=list(methods))
                for path, methods in fleet_control.OTHER_METHODS.items()
            ),
            *(Route(path, control, methods=["GET", "POST"]) for path in fleet_control.PER_ENGINE),
            # (SGLang's sessions: GET or POST, as SGLang takes them)
            *(Route(path, sessions, methods=["GET", "POST"]) for path in SESSION_PATHS),
        ],
        lifespan=lifespan,
    )
    # (SGLang's /generate and vLLM's token API too: its workers may be either, and this app has
    # no path of its own there)
    middleware = KvMeshMiddleware(inner, settings=settings, tokenizer=tokenizer, generation_paths=EVERY_PATH)
    return middleware
