"""The runtime one middleware instance shares between its requests.

``Mesh`` owns the KvRouter, the worker registry, the HTTP client towards peers, the tokenizer and
the waiters of queued requests, plus one housekeeping task (release queued requests, expire idle
sessions and stale requests). With ``--router-replica-sync`` it also owns the ReplicaSync sockets
and finds the peers to follow: every up worker that answers ``GET /kvmesh/router`` (an engine
embedding the middleware), plus the configured ``sync_peers``. It starts on the ASGI lifespan startup or, when the server sends no
lifespan events, on the first request: engines like vLLM build the middleware with no arguments
before any event loop runs.

Per-request state never lives here; see :mod:`kvmesh.router.asgi.routed`.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import os
import random
import socket
import time
from typing import Any
from urllib.parse import urlsplit

from kvmesh._types import WorkerId
from kvmesh.errors import ConfigError
from kvmesh.router.core.kv_router import Decision, KvRouter
from kvmesh.router.mesh.metrics import GaugeSource, WorkerRow, get_metrics
from kvmesh.router.mesh.registry import WorkerRegistry
from kvmesh.router.mesh.replica_sync import ReplicaSync
from kvmesh.router.mesh.settings import MeshSettings
from kvmesh.router.mesh.worker_rpc import ADMIN_TOKEN_HEADER, WorkerRpc
from kvmesh.router.request.nvext import NvextLimits
from kvmesh.router.request.tokenizer import BuiltinTokenizer, HfTokenizer, Tokenizer
from kvmesh.router.upstream.forwarder import ConnectFailed, Forwarder

logger = logging.getLogger("kvmesh.router")

ASGIApp = Any
_HOUSEKEEPING_INTERVAL = 0.25
# Exponential moving average weight of one request in the reported/predicted cached-token ratio.
_RATIO_ALPHA = 0.05
ROUTER_PATH = "/kvmesh/router"
# A worker that does not answer GET /kvmesh/router (no middleware) is asked again after this long.
_PEER_RETRY_SECS = 30.0


def load_tokenizer(name: str, engine_tokenizer: Tokenizer | None) -> Tokenizer:
    """``builtin`` | ``engine`` (the embedding engine's own) | a local Hugging Face path."""
    if engine_tokenizer is not None and name in ("engine", "builtin"):
        return engine_tokenizer if name == "engine" else BuiltinTokenizer()
    if name == "builtin":
        return BuiltinTokenizer()
    if name == "engine":
        raise ConfigError("KVMESH_TOKENIZER=engine, but the engine passed no tokenizer to the middleware")
    if not os.path.exists(name):
        raise ConfigError(f"KVMESH_TOKENIZER {name!r} is neither 'builtin' nor an existing local path")
    return HfTokenizer(name)


class Mesh:
    def __init__(
        self,
        settings: MeshSettings,
        *,
        local_app: ASGIApp | None = None,
        tokenizer: Tokenizer | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.settings = settings
        self.config = settings.router
        # perf_counter times find_matches inside route() (the core never reads a clock itself)
        self.router = KvRouter(settings.router, rng or random.Random(), clock=time.perf_counter)
        self.forwarder = Forwarder(connect_timeout=settings.connect_timeout)
        self.metrics = get_metrics()
        self.tokenizer = load_tokenizer(settings.tokenizer, tokenizer)
        self.local_app = local_app if settings.self_worker_id is not None else None
        self.rpc = WorkerRpc(
            self.forwarder,
            timeout=settings.connect_timeout,
            state_timeout=settings.kv_state_timeout,
            token=settings.worker_token,  # never the admin token: that one guards this router
            # ... except in-process to this engine's own RPCs, which an engine that sets only
            # KVMESH_ADMIN_TOKEN guards with it (kvmesh.worker.rpc.worker_token_from_env)
            local_token=settings.worker_token or settings.admin_token,
            local_id=settings.self_worker_id,
            local_app=self.local_app,
        )
        self.registry = WorkerRegistry(settings, self.router, self.forwarder, self.metrics, self.rpc)
        self.replica = settings.self_worker_id or (
            f"router-{socket.gethostname()}-{os.getpid()}-{id(self) & 0xFFFF:x}"
        )
        # A random per-process epoch makes request ids unique across restarts and replicas: peers
        # key their copy of our load by them.
        self.epoch = int.from_bytes(os.urandom(4), "big")
        self._id_prefix = f"{self.replica}-{self.epoch:08x}-"
        self.kv_mode = self.config.router_mode == "kv"
        self.nvext_limits = NvextLimits(
            session_id_max_len=self.config.router_session_id_max_len,
            session_timeout_max=self.config.router_session_timeout_max_secs,
        )
        self.sync: ReplicaSync | None = None
        if self.config.router_replica_sync and self.kv_mode:
            host = urlsplit(settings.self_url).hostname if settings.self_url else None
            self.sync = ReplicaSync(
                self.router,
                self.replica,
                self.epoch,
                endpoint=settings.sync_endpoint or f"tcp://{host or '127.0.0.1'}:*",
                advertise_host=host,
                interval=min(settings.health_interval, 1.0),
            )
            if not settings.mesh_secret and settings.self_worker_id is not None:
                logger.warning(
                    "kvmesh: replica sync without a mesh secret (KVMESH_MESH_SECRET): requests forwarded "
                    "to this engine cannot be proven to come from a replica, so they count in this "
                    "replica's load view twice until they end (docs/security.md)"
                )
        self._peer_endpoints: dict[WorkerId, str] = {}
        self._pins: dict[WorkerId, list[float]] = {}  # per worker: a heap of pin expiries
        self._peer_retry: dict[WorkerId, float] = {}
        self._discovery: asyncio.Task[None] | None = None
        self.waiters: dict[str, asyncio.Future[Decision]] = {}
        self._spawned: set[asyncio.Task[Any]] = set()
        self._ids = itertools.count()
        self._started = False
        self._housekeeping: asyncio.Task[None] | None = None
        self._predicted: dict[WorkerId, float] = {}
        self._ratio: dict[WorkerId, float] = {}
        self.metrics.track(
            self,
            GaugeSource(
                self.replica,
                self._worker_rows,
                lambda: self.router.queue_pending,
                self._live_ratios,
            ),
        )

    # ---------------------------------------------------------------- lifecycle
    async def ensure_started(self) -> None:
        if self._started:
            return
        self._started = True
        if self.sync is not None:
            self.sync.start()
            for endpoint in self.settings.sync_peers:
                self.sync.follow(endpoint)
            self._discovery = asyncio.create_task(self._discover_peers(), name="kvmesh-sync-discovery")
        await self.registry.start()
        self._housekeeping = asyncio.create_task(self._housekeep(), name="kvmesh-housekeeping")

    async def wait_ready(self) -> None:
        ready = self.registry.ready
        if not ready.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(ready.wait(), self.settings.connect_timeout + 2.0)

    async def stop(self) -> None:
        for task in (self._housekeeping, self._discovery):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._housekeeping = self._discovery = None
        for task in list(self._spawned):
            task.cancel()
        if self.sync is not None:
            await self.sync.stop()
        await self.registry.stop()
        await self.forwarder.close()
        for fut in self.waiters.values():
            fut.cancel()
        self.waiters.clear()
        self._started = False

    async def _housekeep(self) -> None:
        while True:
            await asyncio.sleep(_HOUSEKEEPING_INTERVAL)
            try:
                now = time.monotonic()
                self.pump(now)
                for expired in self.router.expire(now):
                    self.spawn(self.close_session(expired.worker[0], expired.session_id))
            except Exception:  # housekeeping must survive a bug in one round
                logger.exception("kvmesh housekeeping round failed")

    # ---------------------------------------------------------------- requests
    def next_request_id(self) -> str:
        return f"{self._id_prefix}{next(self._ids)}"

    # ---------------------------------------------------------------- replica sync
    def describe(self) -> dict[str, Any]:
        """``GET /kvmesh/router``: who this replica is and where peers follow its decisions."""
        sync = self.sync
        return {
            "replica": self.replica,
            "epoch": self.epoch,
            "router_mode": self.config.router_mode,
            "replica_sync": sync is not None,
            "router_sync_endpoint": sync.endpoint if sync is not None else None,
            **({"sync": sync.describe()} if sync is not None else {}),
        }

    async def _discover_peers(self) -> None:
        """Follow the sync endpoint of every up worker that embeds the middleware; unfollow the
        ones that went down or were removed (their requests expire with their heartbeats)."""
        await self.registry.ready.wait()
        while True:
            try:
                await self._discover_once(time.monotonic())
            except Exception:  # discovery must survive a bug in one round
                logger.exception("kvmesh replica discovery round failed")
            await asyncio.sleep(self.settings.health_interval)

    async def _discover_once(self, now: float) -> None:
        sync = self.sync
        assert sync is not None
        registry = self.registry
        for worker_id in [w for w in self._peer_endpoints if w not in registry.routable]:
            sync.unfollow(self._peer_endpoints.pop(worker_id))
            self._peer_retry.pop(worker_id, None)
        asks = [
            w
            for w in registry.routable
            if w not in self._peer_endpoints
            and not registry.is_local(w)
            and self._peer_retry.get(w, 0.0) <= now
        ]
        answers = await asyncio.gather(*(self._ask_router(w) for w in asks))
        for worker_id, endpoint in zip(asks, answers, strict=True):
            if endpoint is None:
                self._peer_retry[worker_id] = now + _PEER_RETRY_SECS
            elif worker_id in registry.routable:
                self._peer_endpoints[worker_id] = endpoint
                sync.follow(endpoint)

    async def _ask_router(self, worker_id: WorkerId) -> str | None:
        worker = self.registry.get(worker_id)
        if worker is None:
            return None
        # A peer's replica description is asked for with the worker token: the admin token guards
        # this router alone and is never sent anywhere.
        token = self.settings.worker_token
        headers = {ADMIN_TOKEN_HEADER: token} if token else None
        try:
            doc = await self.forwarder.get_json(
                worker.url + ROUTER_PATH, timeout=self.settings.connect_timeout, headers=headers
            )
        except ConnectFailed:
            return None
        endpoint = doc.get("router_sync_endpoint") if isinstance(doc, dict) else None
        return endpoint if isinstance(endpoint, str) and endpoint.startswith("tcp://") else None

    def pump(self, now: float) -> None:
        """Hand capacity freed by feedback to queued requests."""
        if not self.waiters:
            return
        for decision in self.router.release(now):
            fut = self.waiters.pop(decision.request_id, None)
            if fut is not None and not fut.done():
                fut.set_result(decision)
            elif fut is None:  # its client left between release and now
                self.router.cancel(decision.request_id, now)

    def spawn(self, coro: Any) -> None:
        """Fire-and-forget a worker RPC; failures are logged, never raised at a request. The task
        is kept in a set until it ends: the event loop holds tasks only weakly."""
        task = asyncio.get_running_loop().create_task(coro)
        self._spawned.add(task)
        task.add_done_callback(self._spawned.discard)
        task.add_done_callback(_log_failure)

    def record_cached(self, worker: WorkerId, predicted: int, reported: int) -> None:
        """Compare the router's predicted cached tokens with what the engine reported."""
        self.metrics.predicted_cached.labels(worker).inc(predicted)
        self.metrics.reported_cached.labels(worker).inc(reported)
        if predicted > 0:
            sample = min(reported / predicted, 2.0)
            old = self._ratio.get(worker)
            self._ratio[worker] = sample if old is None else old + _RATIO_ALPHA * (sample - old)

    def _live_ratios(self) -> list[tuple[WorkerId, float]]:
        workers = self.registry.workers  # a removed worker's ratio goes with it
        return [(w, r) for w, r in self._ratio.items() if w in workers]

    def _worker_rows(self) -> list[WorkerRow]:
        return [
            (s.worker[0], s.worker[1], float(s.active_decode_blocks), float(s.active_prefill_tokens))
            for s in self.router.worker_snapshot()
        ]

    # ---------------------------------------------------------------- worker RPCs
    async def open_session(self, worker_id: WorkerId, session_id: str, timeout: float | None) -> Any:
        """Open an engine session on a worker that serves kvmesh's RPCs (None when it does not)."""
        w = self.registry.rpc_target(worker_id)
        return None if w is None else await self.rpc.open_session(worker_id, w.url, session_id, timeout)

    async def close_session(self, worker_id: WorkerId, session_id: str) -> Any:
        w = self.registry.rpc_target(worker_id)
        return None if w is None else await self.rpc.close_session(worker_id, w.url, session_id)

    def take_pin(self, worker_id: WorkerId, ttl_seconds: float, now: float) -> bool:
        """Count a ``cache_control`` pin on ``worker_id`` for ``ttl_seconds``; False when the worker
        already holds ``--router-max-pins-per-worker`` live pins asked for by this router."""
        expiries = self._pins.setdefault(worker_id, [])
        while expiries and expiries[0] <= now:
            heapq.heappop(expiries)
        if len(expiries) >= self.config.router_max_pins_per_worker:
            return False
        heapq.heappush(expiries, now + ttl_seconds)
        return True

    async def pin_prefix(self, worker_id: WorkerId, token_ids: list[int], ttl_seconds: float) -> Any:
        w = self.registry.rpc_target(worker_id)
        return None if w is None else await self.rpc.pin_prefix(worker_id, w.url, token_ids, ttl_seconds)


def _log_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.warning("kvmesh worker RPC failed: %s", task.exception())
