"""The standalone router's ``POST /flush_cache`` (SGLang's name for it; GET too, as SGLang takes
both) and ``POST /reset_prefix_cache`` (vLLM's): empty the prefix cache of every worker at once.

A loop that loads new weights into its engines (RL training, a hot model swap) must then drop what
they cached under the old weights, and a client pointed at the router has one address for the whole
fleet; sglang-router answers ``/flush_cache`` for its fleet the same way. Before, the router had a
404 for both paths.

Every up worker is asked the way it understands: kvmesh's worker RPC
(``/kvmesh/reset_prefix_cache``) where it serves kvmesh's RPCs, else its engine's own path (SGLang's
``/flush_cache``, vLLM's ``/reset_prefix_cache``, for another server the path the client called),
with the client's query string and ``authorization`` (unless that is the router's admin token). The
router then forgets what it predicted the flushed workers cache. What their KV events said, their
events clear: an engine's flush publishes "all blocks cleared", and a block stored after the flush
must not be dropped with the rest.

The answer is 200 with ``{"flushed": [worker ids]}`` when every worker flushed; otherwise a 502
error that also lists ``flushed`` and ``failed`` (worker id: why). vLLM refuses while blocks are in
use, as SGLang does while requests run. A 503 when no worker is up. With an admin token set, the
token is required, as on the router's admin endpoints. Inside an engine the middleware leaves these
paths to that engine: there they mean its own cache.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvmesh._http import error_body, route_path, token_matches
from kvmesh.router.mesh.registry import UP, Worker
from kvmesh.router.mesh.runtime import Mesh
from kvmesh.router.upstream.forwarder import UpstreamError

PATHS = ("/flush_cache", "/reset_prefix_cache")
_ENGINE_PATH = {"sglang": "/flush_cache", "vllm": "/reset_prefix_cache"}
_RPC_PATH = "/kvmesh/reset_prefix_cache"
_FLUSH_TIMEOUT = 30.0
"""Seconds a worker has to empty its cache (an engine may first finish a scheduler step)."""


class FlushEveryWorker:
    """The endpoint of :data:`PATHS`, :meth:`serve` (see the module docstring)."""

    def __init__(self, mesh_of: Callable[[], Mesh]) -> None:
        self._mesh_of = mesh_of  # (the router's mesh exists only once the middleware is built)

    async def serve(self, request: Request) -> Response:
        mesh = self._mesh_of()
        if not token_matches(mesh.settings.admin_token, request.scope["headers"]):
            return _error(401, "admin token missing or wrong")
        await mesh.ensure_started()
        await mesh.wait_ready()
        workers = [w for w in mesh.registry.workers.values() if w.state == UP and w.info is not None]
        if not workers:
            return _error(503, "no worker is up")
        answers = await asyncio.gather(*(self._flush(mesh, w, request) for w in workers))
        flushed = sorted(w.worker_id for w, why in zip(workers, answers, strict=True) if why is None)
        failed = {w.worker_id: why for w, why in zip(workers, answers, strict=True) if why is not None}
        for worker_id in flushed:
            mesh.router.flushed(worker_id)
        if failed:
            body = error_body(f"{len(failed)} of {len(workers)} workers did not flush", 502, None)
            return JSONResponse({**body, "flushed": flushed, "failed": failed}, status_code=502)
        return JSONResponse({"flushed": flushed})

    async def _flush(self, mesh: Mesh, worker: Worker, request: Request) -> str | None:
        """Flush one worker: None when it did, else why not."""
        info = worker.info
        assert info is not None
        try:
            if info.has_rpc:
                await mesh.rpc.call(
                    worker.worker_id, worker.url, "POST", _RPC_PATH, {}, timeout=_FLUSH_TIMEOUT
                )
                return None
            path = _ENGINE_PATH.get(info.backend, route_path(request.scope))
            if request.url.query:
                path += "?" + request.url.query
            auth = request.headers.get("authorization")
            if (
                auth
                and mesh.settings.admin_token
                and token_matches(mesh.settings.admin_token, [(b"authorization", auth.encode("latin-1"))])
            ):
                auth = None  # (the router's own admin token is never sent on)
            headers = {"authorization": auth} if auth else None
            status, body = await mesh.forwarder.post(
                worker.url + path, None, timeout=_FLUSH_TIMEOUT, headers=headers
            )
        except UpstreamError as e:
            return str(e)
        if status != 200:
            return f"HTTP {status}: {body[:200].decode('utf-8', 'replace')}"
        return None


def _error(status: int, message: str) -> Response:
    return JSONResponse(error_body(message, status, None), status_code=status)


__all__ = ["PATHS", "FlushEveryWorker"]
