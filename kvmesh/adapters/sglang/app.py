"""kvmesh mounted on SGLang's FastAPI ``app`` (``sglang.srt.entrypoints.http_server.app``).

:func:`mount` adds, once per app:

* the ``/kvmesh/*`` worker routes (:func:`kvmesh.worker.rpc.worker_rpc_routes`) over a
  :class:`~.backend.SglangWorkerBackend` built on first use from SGLang's global state. SGLang's
  ``--api-key`` middleware is added after this (at server start), so it runs first: with a key
  set, ``/kvmesh/*`` wants ``Authorization: Bearer <key>`` like every SGLang route, and
  ``KVMESH_ADMIN_TOKEN`` (when set) is checked on top;
* a pure-ASGI wrapper that starts the ``kv_state`` event follower at lifespan start-up;
* kvmesh's router middleware (:mod:`.middleware`) when a mesh is configured (``KVMESH_WORKERS``
  or ``KVMESH_CONFIG``), or always with ``router=True``.

Importing this module as ``kvmesh.adapters.sglang.app:app`` gives SGLang's app with kvmesh
mounted, from the settings the launcher left in the environment: with
``--tokenizer-worker-num > 1`` uvicorn imports the app by name in each worker process
(``SGLANG_HTTP_SERVER_APP_PATH``), and anything added to the parent's app object is lost there.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from kvmesh.adapters.sglang._sglang import import_sglang
from kvmesh.adapters.sglang.backend import SglangWorkerBackend
from kvmesh.adapters.sglang.control import CONTROL_ENV
from kvmesh.adapters.sglang.follower import KvStateFollower
from kvmesh.adapters.sglang.publisher import offset_endpoint
from kvmesh.errors import RequestError
from kvmesh.router.mesh.settings import mesh_configured
from kvmesh.worker.advertise import advertise_host_from_env, reachable
from kvmesh.worker.rpc import worker_rpc_routes

logger = logging.getLogger("kvmesh.adapters.sglang")

_MOUNTED = "_kvmesh_mounted"


def event_endpoints(kv_events_config: str | None, dp_size: int, host: str | None) -> dict[str, Any] | None:
    """Per-rank live and replay endpoints of ``--kv-events-config``, dialable at ``host`` (a
    wildcard bind becomes ``host``); None when SGLang publishes no events over tcp or ipc."""
    if not kv_events_config:
        return None
    config = json.loads(kv_events_config)
    if config.get("publisher", "null") == "null":
        return None
    endpoint = config.get("endpoint", "tcp://*:5557")
    replay = config.get("replay_endpoint")

    def at(ep: str | None, rank: int) -> str | None:
        out = offset_endpoint(ep, rank) if ep else None
        return None if out is None else reachable(out, host)

    return {
        "endpoints": [at(endpoint, r) for r in range(dp_size)],
        "replay_endpoints": [at(replay, r) for r in range(dp_size)],
        "topic": config.get("topic", ""),
    }


class _Worker:
    """The backend and the follower, built from SGLang's state when first needed."""

    def __init__(self, app: Any, server_args: Any) -> None:
        self.app = app
        self.server_args = server_args
        self.advertise_host = advertise_host_from_env()  # (read as kvmesh mounts: a bad one stops the start)
        self._backend: SglangWorkerBackend | None = None
        self._follower: KvStateFollower | None = None
        self._follower_started = False

    def _args(self) -> Any:
        args = self.server_args or getattr(self.app, "server_args", None)
        if args is None:
            raise RequestError("SGLang's server is not ready", status=503)
        return args

    def follower(self) -> KvStateFollower | None:
        if self._follower is None:
            args = self._args()
            dp = int(getattr(args, "dp_size", 1) or 1)
            local = event_endpoints(getattr(args, "kv_events_config", None), dp, "127.0.0.1")
            if local is None:
                return None
            self._follower = KvStateFollower(
                int(getattr(args, "page_size", None) or 1),
                local["endpoints"],
                local["replay_endpoints"],
                topic=local["topic"],
            )
        return self._follower

    def start_follower(self) -> None:
        if not self._follower_started:
            follower = self.follower()
            if follower is not None:
                follower.start()
            self._follower_started = True

    def backend(self) -> SglangWorkerBackend:
        if self._backend is None:
            from sglang.srt.entrypoints import http_server

            state = http_server.get_global_state()
            if state is None or state.tokenizer_manager is None:
                raise RequestError("SGLang's server is not ready", status=503)
            args = self._args()
            dp = int(getattr(args, "dp_size", 1) or 1)
            self._backend = SglangWorkerBackend(
                args,
                events=event_endpoints(getattr(args, "kv_events_config", None), dp, self.advertise_host),
                control_base=os.environ.get(CONTROL_ENV),
                tokenizer_manager=state.tokenizer_manager,
                scheduler_info=state.scheduler_info,
                follower=self.follower(),
            )
        return self._backend


class _LateBackend:
    def __init__(self, worker: _Worker) -> None:
        self._worker = worker

    def info(self) -> dict[str, Any]:
        return self._worker.backend().info()

    def kv_state(self) -> dict[str, Any]:
        return self._worker.backend().kv_state()

    async def pin_prefix(self, token_ids: list[int], ttl_seconds: float) -> int:
        return await self._worker.backend().pin_prefix(token_ids, ttl_seconds)

    async def open_session(self, session_id: str, timeout: float) -> bool:
        return await self._worker.backend().open_session(session_id, timeout)

    async def close_session(self, session_id: str) -> bool:
        return await self._worker.backend().close_session(session_id)

    async def reset_prefix_cache(self) -> bool:
        return await self._worker.backend().reset_prefix_cache()


class FollowerStarter:
    """Pure ASGI: starts the kv_state follower when the app starts (or on its first request)."""

    def __init__(self, app: Any, *, worker: _Worker) -> None:
        self.app = app
        self.worker = worker

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":

            async def started(message: dict[str, Any]) -> None:
                if message["type"] == "lifespan.startup.complete":
                    self._start()
                await send(message)

            await self.app(scope, receive, started)
            return
        if scope["type"] == "http":
            self._start()
        await self.app(scope, receive, send)

    def _start(self) -> None:
        try:
            self.worker.start_follower()
        except Exception:
            logger.exception("kvmesh: could not start the kv_state follower")


def mount(app: Any, server_args: Any = None, *, router: bool | None = None) -> Any:
    """Add kvmesh's routes, follower and (with a mesh configured) middleware to SGLang's ``app``;
    a second call on the same app does nothing. Returns the app."""
    if getattr(app.state, _MOUNTED, False):
        return app
    worker = _Worker(app, server_args)
    token = os.environ.get("KVMESH_ADMIN_TOKEN") or None
    app.router.routes.extend(worker_rpc_routes(_LateBackend(worker), admin_token=token))
    app.add_middleware(FollowerStarter, worker=worker)
    if router if router is not None else mesh_configured():
        from kvmesh.adapters.sglang.middleware import KvMeshMiddleware

        app.add_middleware(KvMeshMiddleware)
    setattr(app.state, _MOUNTED, True)
    return app


def __getattr__(name: str) -> Any:
    """``app``: SGLang's app with kvmesh mounted (for ``SGLANG_HTTP_SERVER_APP_PATH``)."""
    if name != "app":
        raise AttributeError(name)
    import_sglang()
    from sglang.srt.entrypoints import http_server

    return mount(http_server.app)
