"""The router's end of the NATS event plane: one connection, discovery into the registry, status.

With ``--event-plane nats://...`` a router process keeps one :class:`NatsLink` (instead of a ZMQ
socket per worker rank and per peer replica). Through it

* the event feed follows ``nats:<subject>`` event streams (:mod:`kvmesh.events.nats_subscriber`);
* replica sync publishes and listens on ``<prefix>.sync.*`` (:mod:`.replica_sync`);
* :class:`NatsDiscovery` watches the worker bucket and adds / removes workers at the registry.
  Workers from ``--workers`` stay under the router's own control: the bucket never removes them,
  and one registered under the same id is the same worker.
* :class:`SelfAnnouncement`: a router embedded in an engine (``self_url`` set: vLLM, SGLang, the
  mock or any app wrapped by the middleware) registers that engine in the bucket, so the other
  replicas and standalone routers find it without a ``--workers`` list.

When NATS is away the router keeps routing on what it knows: discovered workers stay, indexes
stay, health checks go on over HTTP; ``describe()`` (in ``/kvmesh/router`` and ``/health``) and
the ``kvmesh_event_plane_connected`` gauge say so. On reconnection the subscribers re-sync from
the stream and the bucket is read again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from kvmesh._types import WorkerId
from kvmesh.errors import ConfigError
from kvmesh.events.nats_discovery import WorkerAnnouncer, WorkerWatcher
from kvmesh.events.nats_link import NatsLink
from kvmesh.router.mesh.registry import WorkerConflict, WorkerRegistry
from kvmesh.router.mesh.settings import worker_from_info
from kvmesh.router.mesh.worker_rpc import WorkerRpc
from kvmesh.router.upstream.forwarder import ConnectFailed

logger = logging.getLogger("kvmesh.router")

# How long the embedding engine may take to answer its own /kvmesh/info before the entry goes out
# without facts (routers then ask the engine over HTTP, as for a --workers entry).
_INFO_PATIENCE_S = 10.0


class NatsDiscovery:
    """Workers that announce themselves in the bucket join the registry; expired ones leave it."""

    def __init__(self, link: NatsLink, registry: WorkerRegistry, *, ttl: float) -> None:
        self.registry = registry
        self.static: frozenset[WorkerId] = frozenset(registry.workers)
        self.discovered: set[WorkerId] = set()
        self.refused: dict[WorkerId, str] = {}
        self._adding: set[WorkerId] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self.watcher = WorkerWatcher(link, self._seen, self._gone, default_ttl=ttl)

    def start(self) -> None:
        self.watcher.start()

    async def stop(self) -> None:
        await self.watcher.stop()
        for task in list(self._tasks):
            task.cancel()

    def describe(self) -> dict[str, Any]:
        return {"discovered": sorted(self.discovered), "refused": dict(self.refused)}

    async def _seen(self, doc: dict[str, Any]) -> None:
        worker_id = str(doc["id"])
        if worker_id in self.static or worker_id in self._adding or worker_id in self.registry.workers:
            return
        info = doc.get("info")
        if not isinstance(info, dict):
            info = {}
        try:
            spec = worker_from_info(info, doc["url"], worker_id, f"bucket entry {worker_id}")
        except ConfigError as e:
            self._refuse(worker_id, str(e))
            return
        self._adding.add(worker_id)
        task = asyncio.get_running_loop().create_task(self._add(spec))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _add(self, spec: Any) -> None:
        try:
            await self.registry.add(spec)
            self.discovered.add(spec.worker_id)
            self.refused.pop(spec.worker_id, None)
            logger.info("worker %s (%s) discovered through NATS", spec.worker_id, spec.url)
        except WorkerConflict as e:
            self._refuse(spec.worker_id, str(e))
        finally:
            self._adding.discard(spec.worker_id)

    def _refuse(self, worker_id: WorkerId, reason: str) -> None:
        if self.refused.get(worker_id) != reason:
            logger.error("worker %s from the NATS bucket refused: %s", worker_id, reason)
        self.refused[worker_id] = reason

    async def _gone(self, worker_id: str) -> None:
        self.refused.pop(worker_id, None)
        if worker_id in self.discovered:
            self.discovered.discard(worker_id)
            await self.registry.remove(worker_id)
            logger.info("worker %s left the NATS bucket", worker_id)


class SelfAnnouncement:
    """The embedding engine's entry in the worker bucket, renewed every ``ttl / 3`` seconds.

    The entry carries the engine's own ``/kvmesh/info`` (read in-process through ``rpc``, so it
    says exactly what a router would read over HTTP). The engine may still be starting when the
    mesh starts: the info is asked every half second, and the first announcement waits for it
    for up to ten seconds; an engine without ``/kvmesh/info`` (a plain app behind the generic
    middleware) is then announced with its URL alone. ``stop()`` deletes the entry."""

    def __init__(self, link: NatsLink, rpc: WorkerRpc, worker_id: WorkerId, url: str, *, ttl: float) -> None:
        self.rpc = rpc
        self.url = url
        self.info: dict[str, Any] = {}
        self.announcer = WorkerAnnouncer(link, worker_id, url, lambda: self.info, interval=ttl / 3, ttl=ttl)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="kvmesh-self-announce")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.announcer.stop()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        give_up = loop.time() + _INFO_PATIENCE_S
        while loop.time() < give_up:
            try:
                raw = await self.rpc.info(self.announcer.worker_id, self.url)
            except ConnectFailed as e:
                logger.debug("own /kvmesh/info not available yet (%s)", e)
                await asyncio.sleep(0.5)
                continue
            if isinstance(raw, dict):
                self.info = raw
            break
        else:
            logger.warning(
                "this engine serves no /kvmesh/info; announcing %s in the NATS bucket without it", self.url
            )
        self.announcer.start()
