"""Worker discovery through a NATS key-value bucket: workers announce, routers watch.

A worker's entry (key: its name as a subject token) is JSON ``{"id", "url", "info", "ttl"}``:
its id, base URL and its ``/kvmesh/info`` facts. :class:`WorkerAnnouncer` writes it every
``interval`` seconds and deletes it on a clean stop. :class:`WorkerWatcher` follows the bucket and
calls ``on_seen(doc)`` for every write and ``on_gone(worker_id)`` when an entry is deleted or was
not renewed for its ``ttl``. The bucket's own TTL cleans entries up for later watchers; the
watcher keeps its own timers as well, because a TTL expiry is not announced by every server
version. Timers only run while NATS is connected: a router cut off from NATS keeps its workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from kvmesh.events.nats_link import NatsLink, import_nats, subject_token, worker_bucket

logger = logging.getLogger("kvmesh.events")


class WorkerAnnouncer:
    """Keeps one worker's entry in the bucket alive while it runs."""

    def __init__(
        self,
        link: NatsLink,
        worker_id: str,
        url: str,
        info: Callable[[], dict[str, Any]],
        *,
        interval: float = 2.0,
        ttl: float | None = None,
    ) -> None:
        self.link = link
        self.worker_id = worker_id
        self.url = url
        self.key = subject_token(worker_id)
        self._info = info
        self.interval = interval
        self.ttl = ttl if ttl is not None else 3 * interval
        self.puts = 0
        self.held_by: str | None = None
        """Another worker's id, while its live entry holds this worker's key (see ``_key_is_free``)."""
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._wrote = False

    def start(self) -> None:
        if self._task is None:
            self._stopping = False
            self._task = asyncio.get_running_loop().create_task(self._run(), name="kvmesh-announce")

    async def stop(self, *, delete: bool = True) -> None:
        """Stop renewing; ``delete`` removes the entry at once (else it expires after ``ttl``)."""
        # The flag, not only the cancellation, ends the renewal loop, as in WorkerWatcher: a
        # cancellation that lands as a put's acknowledgement arrives is swallowed by the
        # ``asyncio.wait_for`` inside nats-py's request (Python 3.11), and the loop went on
        # renewing, so this await never returned (most likely what hung a test's engine teardown
        # for 300 s in a CI run).
        self._stopping = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if delete and self.link.connected and self._wrote and self.held_by is None:  # (its own entry only)
            with contextlib.suppress(Exception):
                kv = await worker_bucket(self.link.js, self.link.options, self.ttl)
                await kv.delete(self.key)

    async def _run(self) -> None:
        kv = None
        while not self._stopping:
            if await self.link.wait_connected(self.interval):
                try:
                    if kv is None:
                        kv = await worker_bucket(self.link.js, self.link.options, self.ttl)
                    if await self._key_is_free(kv):
                        doc = {"id": self.worker_id, "url": self.url, "info": self._info(), "ttl": self.ttl}
                        self._wrote = True  # (a put whose acknowledgement is lost may still land)
                        await kv.put(self.key, json.dumps(doc).encode())
                        self.puts += 1
                except Exception as e:  # NATS away or electing: the next round tries again
                    logger.debug("worker announcement failed: %s", e)
                await asyncio.sleep(self.interval)

    async def _key_is_free(self, kv: Any) -> bool:
        """Whether this worker may write its key: no live entry there, or its own. Two worker ids
        can make one key (``gpu.0`` and ``gpu_0``: the key is a subject token); each renewal then
        overwrote the other's entry, and routers kept a stopped one of the two for as long as the
        other renewed. The worker that finds its key held waits, and says so once."""
        nats = import_nats()
        try:
            entry = await kv.get(self.key)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            entry = None
        holder = None
        if entry is not None and entry.value:
            with contextlib.suppress(ValueError, TypeError, KeyError):
                holder = str(json.loads(entry.value)["id"])
        if holder is None or holder == self.worker_id:
            self.held_by = None
            return True
        if holder != self.held_by:
            logger.error(
                "worker %r is not registered: its NATS key %r is held by worker %r, whose id makes "
                "the same key; give one of them another id (waiting for that entry to go)",
                self.worker_id,
                self.key,
                holder,
            )
        self.held_by = holder
        return False


class WorkerWatcher:
    """Follows the bucket; reports workers that appear, renew and disappear."""

    def __init__(
        self,
        link: NatsLink,
        on_seen: Callable[[dict[str, Any]], Awaitable[None]],
        on_gone: Callable[[str], Awaitable[None]],
        *,
        default_ttl: float = 6.0,
    ) -> None:
        self.link = link
        self._on_seen = on_seen
        self._on_gone = on_gone
        self._default_ttl = default_ttl
        self.workers: dict[str, tuple[str, float, float]] = {}
        """key -> (worker id, last renewal (monotonic), ttl)."""
        self._task: asyncio.Task[None] | None = None
        self._reaper: asyncio.Task[None] | None = None
        self._rewatch = asyncio.Event()
        self._stopping = False

    def start(self) -> None:
        if self._task is None:
            loop = asyncio.get_running_loop()
            self._stopping = False
            self._rewatch = asyncio.Event()
            self.link.on_up(self._on_link_up)
            self._task = loop.create_task(self._run(), name="kvmesh-discovery-watch")
            self._reaper = loop.create_task(self._reap(), name="kvmesh-discovery-reap")

    async def _on_link_up(self) -> None:
        # After a reconnection the server may have lost the watch's consumer: watch again, which
        # also hands out every current entry (renewing them all).
        self._rewatch.set()

    async def stop(self) -> None:
        self.link.remove_listener(self._on_link_up)
        # The flag, not only the cancellation, ends the watch loop: nats-py's ``updates(timeout=)``
        # can swallow a cancellation that races its own timeout, and the loop would go on forever.
        self._stopping = True
        self._rewatch.set()
        for task in (self._task, self._reaper):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._task = self._reaper = None

    async def _run(self) -> None:
        nats = import_nats()
        while not self._stopping:
            await self.link.wait_connected()
            watcher = None
            self._rewatch.clear()
            try:
                kv = await worker_bucket(self.link.js, self.link.options, self._default_ttl)
                watcher = await kv.watchall()
                while not self._rewatch.is_set():
                    with contextlib.suppress(nats.errors.TimeoutError):
                        entry = await watcher.updates(timeout=0.5)
                        if entry is not None:
                            await self._handle(entry)
            except asyncio.CancelledError:
                raise
            except (nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError) as e:
                logger.debug("worker watch interrupted (%s); watching again", e)
            except Exception:
                logger.exception("worker watch failed; watching again")
            finally:
                if watcher is not None:
                    with contextlib.suppress(Exception):
                        await watcher.stop()
            if not self._rewatch.is_set() and not self._stopping:
                await asyncio.sleep(0.5)

    async def _handle(self, entry: Any) -> None:
        if entry.operation in ("DEL", "PURGE"):
            known = self.workers.pop(entry.key, None)
            if known is not None:
                await self._on_gone(known[0])
            return
        try:
            doc = json.loads(entry.value)
            worker_id = str(doc["id"])
            str(doc["url"])
            ttl = float(doc.get("ttl") or self._default_ttl)
        except (ValueError, KeyError, TypeError) as e:
            logger.warning("ignoring a malformed worker entry %r: %s", entry.key, e)
            return
        self.workers[entry.key] = (worker_id, time.monotonic(), ttl)
        await self._on_seen(doc)

    async def _reap(self) -> None:
        """Forget entries not renewed for their ttl, counting only time connected to NATS: a
        deadline runs from the later of the last renewal and the last (re)connection."""
        while True:
            await asyncio.sleep(0.25)
            if not self.link.connected:
                continue  # cut off: no renewal could reach us, so none is missing
            now = time.monotonic()
            for key, (wid, seen, ttl) in list(self.workers.items()):
                if now - max(seen, self.link.since) > ttl:
                    self.workers.pop(key, None)
                    logger.warning("worker %s: registration not renewed for %.1f s; gone", wid, ttl)
                    await self._on_gone(wid)
