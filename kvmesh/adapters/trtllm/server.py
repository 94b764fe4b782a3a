"""kvmesh mounted on trtllm-serve's own FastAPI app, by patching ``OpenAIServer``.

trtllm-serve has no middleware or plugin flag. Its ``launch_server`` builds the LLM, then
``OpenAIServer(llm=..., ...)`` (``generator=...`` from 1.2 on), whose ``app`` is a FastAPI instance
that nothing serves until ``await server(host, port, sockets=...)`` hands it to uvicorn. So:

* ``__init__`` is wrapped: after TensorRT-LLM's own constructor, the server's LLM (``generator`` or
  ``llm``, whichever this version has) gets a :class:`.backend.TrtllmWorker`; the ``/kvmesh/*``
  worker RPCs and ``GET /kvmesh/metrics`` (Prometheus; trtllm-serve's ``/metrics`` is its own JSON)
  join the app's routes; :class:`.hints.RequestHintsMiddleware` and then kvmesh's routing
  middleware are added, so kvmesh sees each request first (it is the outermost layer) and the
  hints layer runs right before trtllm-serve's handlers;
* ``__call__`` is wrapped: the worker's tasks (event bridge, retention clock) start on the event
  loop uvicorn runs on, and stop when the server returns.

Both wrappers accept any constructor signature, so the ``llm=`` / ``generator=`` rename needs no
version check. :func:`install` patches the class in every module that bound the name before the
launcher runs trtllm-serve (``tensorrt_llm.serve.openai_server``, ``tensorrt_llm.serve`` and
``tensorrt_llm.commands.serve``): patching the class object itself covers them all.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from prometheus_client import REGISTRY, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvmesh.adapters.trtllm._trtllm import import_trtllm
from kvmesh.adapters.trtllm.backend import TrtllmWorker, WorkerOptions
from kvmesh.adapters.trtllm.hints import RequestHintsMiddleware
from kvmesh.adapters.trtllm.middleware import KvMeshMiddleware
from kvmesh.worker.rpc import worker_rpc_routes, worker_token_from_env

logger = logging.getLogger("kvmesh.adapters.trtllm")

_PATCHED = "__kvmesh_patched__"


def engine_of(server: Any) -> Any:
    """The server's LLM: ``generator`` (TensorRT-LLM 1.2+) or ``llm`` (1.0/1.1)."""
    engine = getattr(server, "generator", None)
    if engine is None:
        engine = getattr(server, "llm", None)
    if engine is None:
        raise AttributeError("trtllm-serve's OpenAIServer has neither 'generator' nor 'llm'")
    return engine


def attach(
    server: Any, options: WorkerOptions, *, middleware_factory: Callable[..., Any] | None = None
) -> TrtllmWorker:
    """Give one constructed OpenAIServer kvmesh's worker, routes and middleware."""
    worker = TrtllmWorker(engine_of(server), model=getattr(server, "model", None), options=options)
    server.kvmesh_worker = worker
    app = server.app
    routes = worker_rpc_routes(worker, admin_token=worker_token_from_env())
    routes.append(Route("/kvmesh/metrics", _metrics, methods=["GET"]))
    app.router.routes.extend(routes)
    app.add_middleware(RequestHintsMiddleware)
    if middleware_factory is None:
        app.add_middleware(KvMeshMiddleware)
    else:
        app.add_middleware(middleware_factory)
    return worker


async def _metrics(request: Request) -> Response:
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)


def patch_server_class(cls: Any, options: WorkerOptions) -> None:
    """Wrap ``cls.__init__`` and ``cls.__call__`` (once) as the module docstring says."""
    if getattr(cls, _PATCHED, False):
        return
    original_init = cls.__init__
    original_call = cls.__call__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        attach(self, options)

    async def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        worker: TrtllmWorker | None = getattr(self, "kvmesh_worker", None)
        if worker is not None:
            worker.start()
        try:
            return await original_call(self, *args, **kwargs)
        finally:
            if worker is not None:
                await worker.stop()

    __init__.__wrapped__ = original_init  # type: ignore[attr-defined]
    __call__.__wrapped__ = original_call  # type: ignore[attr-defined]
    cls.__init__ = __init__
    cls.__call__ = __call__
    setattr(cls, _PATCHED, True)


def install(options: WorkerOptions) -> Any:
    """Patch TensorRT-LLM's OpenAIServer class; returns it."""
    module = import_trtllm("tensorrt_llm.serve.openai_server")
    cls = module.OpenAIServer
    patch_server_class(cls, options)
    return cls
