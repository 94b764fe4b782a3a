"""The standalone router's probes, by the names other routers and the engines give them: readiness
(``/health``, ``/readiness``, ``/ready``, ``/readyz``) follows the fleet, liveness (``/live``, ``/liveness``) follows the process only, so
a fleet that is down does not get its router restarted."""

from __future__ import annotations

import aiohttp

from kvmesh.router.asgi.standalone import build_router_app
from kvmesh.router.core.config import RouterConfig
from kvmesh.router.mesh.settings import MeshSettings, WorkerSpec
from tests.router.fleet import fleet
from tests.router.servers import bound_socket, serve


async def _status(http: aiohttp.ClientSession, url: str) -> tuple[int, dict[str, object]]:
    async with http.get(url) as r:
        return r.status, await r.json()


async def test_with_no_worker_up_the_router_is_live_but_not_ready(http: aiohttp.ClientSession) -> None:
    closed = bound_socket()
    port = closed.getsockname()[1]
    closed.close()  # (nothing listens there: the worker is down from the start)
    settings = MeshSettings(
        workers=(WorkerSpec(f"http://127.0.0.1:{port}", "gone"),),
        router=RouterConfig(use_kv_events=False),
        health_interval=0.2,
    )
    async with serve(build_router_app(settings)) as front:
        for path in ("/health", "/readiness", "/ready", "/readyz"):
            status, body = await _status(http, front.url + path)
            assert (status, body["workers_up"]) == (503, 0), path
        for path in ("/live", "/liveness"):
            assert await _status(http, front.url + path) == (200, {"status": "live"}), path
        async with http.post(front.url + "/live") as r:
            assert r.status == 405


async def test_with_a_worker_up_the_router_is_ready(http: aiohttp.ClientSession) -> None:
    async with fleet(2) as (front, _, _e):
        for path in ("/health", "/readiness", "/ready", "/readyz"):
            status, body = await _status(http, front.url + path)
            assert (status, body["workers_up"]) == (200, 2), path
        assert await _status(http, front.url + "/liveness") == (200, {"status": "live"})
