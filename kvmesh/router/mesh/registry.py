"""The worker registry: which workers exist, what they are, whether they are up.

For each configured worker the registry

1. learns what it is: its ``/kvmesh/info`` (backend, model, block size, dp size, events endpoints,
   max_num_batched_tokens, total KV blocks, priority polarity), with fields of the configured spec
   taking precedence; a plain ``vllm serve --kv-events-config ...`` or SGLang (no kvmesh plugin,
   so no ``/kvmesh/info``) is read from the engine's own routes (vLLM's ``/kv_event_sources`` and
   ``/metrics``, SGLang's ``/server_info``: :mod:`~kvmesh.router.mesh.engine_discovery`), or
   described in full by its spec instead; in round-robin / random mode (or without KV events) a
   plain OpenAI-compatible server needs nothing but its URL;
2. refuses it, loudly, when its block size differs from the fleet's (hashes would never match);
3. registers it with the KvRouter and has the :class:`~kvmesh.router.mesh.event_feed.EventFeed`
   cold-start its index and follow its KV events;
4. health-checks it; a dead worker leaves routing and its blocks leave the index, and it is
   re-admitted through steps 1-3 when it answers again;
5. at each health check, lets the feed probe quiet event streams for a lost final batch;
6. learns which LoRA adapters it serves (``lora_adapters`` in its info, else the ``/v1/models``
   entries whose ``parent`` is another model), so prompts for an adapter are hashed the way the
   engine salts that adapter's blocks and go only to workers that serve it;
7. at each health check, reads the engine's own running / waiting counts from its ``/metrics``
   (:mod:`~kvmesh.router.mesh.engine_load`), shown beside the router's estimate; what they count
   beyond it is load the router did not route there, and the latency cost counts it
   (:meth:`~kvmesh.router.core.kv_router.KvRouter.engine_load`);
8. every few health checks, reads its description again, and takes it down (to be admitted again
   at the next check) when its event endpoints, block size or DP ranks changed: an engine
   restarted between two checks may publish elsewhere.

Workers come from the settings, and at runtime from the admin API (:meth:`WorkerRegistry.add`,
:meth:`WorkerRegistry.remove`).

Worker RPCs go through :class:`~kvmesh.router.mesh.worker_rpc.WorkerRpc`, which reaches the engine
the middleware is embedded in in-process, never over the network.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from kvmesh._types import WorkerId
from kvmesh.errors import KvMeshError, WorkerError
from kvmesh.events.nats_link import NatsLink
from kvmesh.router.core.kv_router import KvRouter
from kvmesh.router.core.timing import Profile
from kvmesh.router.mesh.engine_discovery import NoRoutes, NotDiscovered, read_stock_engine
from kvmesh.router.mesh.engine_load import EngineLoad, parse_engine_load
from kvmesh.router.mesh.event_feed import EventFeed, FeedTarget
from kvmesh.router.mesh.metrics import Metrics
from kvmesh.router.mesh.settings import MeshSettings, WorkerSpec, WorkerSpecError, worker_from_info
from kvmesh.router.mesh.worker_rpc import METRICS_LIMIT, WorkerRpc
from kvmesh.router.upstream.forwarder import ConnectFailed, Forwarder, Refused

logger = logging.getLogger("kvmesh.router")

PENDING, UP, DOWN, REFUSED = "pending", "up", "down", "refused"
# Adapters are re-read every this many health checks (engines can load adapters at runtime).
_ADAPTER_REFRESH_CHECKS = 5
# Capacity assumed for a worker that describes nothing (round-robin / random over plain servers).
_DEFAULT_TOTAL_BLOCKS = 1 << 20
INFO_PATH = "/kvmesh/info"
_DEFAULT_BATCHED_TOKENS = 1 << 20
_PAUSE_READ_S = 1.0
"""Seconds between two asks of one engine whether it is paused, however short the health interval
(a benchmark's 0.25 s would otherwise add four requests a second to every engine)."""
PAUSE_CALLS = frozenset(
    ("/pause", "/resume", "/sleep", "/wake_up", "/pause_generation", "/continue_generation")
)
"""The engines' calls that pause or resume generation (vLLM's, then SGLang's): once one has gone
through a router, it reads at once whether the engines are paused (:meth:`WorkerRegistry.read_pauses_now`)."""
_PAUSE_READS = {"sglang": "/ready", "vllm": "/is_paused", "mock": "/is_paused"}
"""Where an engine says whether it is paused: SGLang's ``/ready`` (503 while paused), vLLM's
``/is_paused`` (``{"is_paused": true}``; served with ``VLLM_SERVER_DEV_MODE=1``, as its ``/pause``
and ``/sleep`` are). The mock answers both, its ``/is_paused`` for either engine's pause."""


class WorkerConflict(WorkerError):
    """A runtime-added worker that clashes with the fleet (duplicate, other block size)."""


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """A worker's description, merged from its spec and its ``/kvmesh/info``."""

    backend: str
    model: str | None
    block_size: int
    dp_size: int
    kv_events_endpoints: tuple[str, ...]
    kv_replay_endpoints: tuple[str | None, ...]
    max_num_batched_tokens: int
    total_kv_blocks: int
    priority_polarity: str
    has_rpc: bool
    """The worker serves kvmesh's RPCs (/kvmesh/kv_state, session_control, pin_prefix)."""
    role: str = "aggregated"
    """``aggregated`` | ``prefill`` | ``decode`` (disaggregated serving)."""
    bootstrap_port: int | None = None
    prefill_profile: tuple[float, float, float] | None = None
    """``timing_profile.prefill_ms`` of its info: prefill ms of T uncached tokens = a2*T^2 + a1*T + a0."""
    tokens_api: bool = False
    """Its server answers vLLM's token-in-token-out API (``/inference/v1/generate``)."""
    described_by: str = "config"
    """Where its facts came from, besides its config entry: ``/kvmesh/info``, or a stock engine's
    own route (vLLM's ``/kv_event_sources``, SGLang's ``/server_info``)."""


@dataclass(slots=True)
class Worker:
    spec: WorkerSpec
    state: str = PENDING
    reason: str | None = None
    info: WorkerInfo | None = None
    failures: int = 0
    since: float = field(default_factory=time.monotonic)
    adapters: frozenset[str] = frozenset()
    """LoRA adapter names the worker serves."""
    checks: int = 0
    engine_load: EngineLoad | None = None
    """What the engine's own ``/metrics`` reported at the last health check that could read it."""
    metrics_misses: int = 0
    """Consecutive health checks whose ``/metrics`` read failed or had no known gauge."""
    paused: bool = False
    """Its engine says it is paused (:data:`_PAUSE_READS`): requests sent there wait, or are refused."""
    reads_pause: bool = True
    """Whether its engine says so at all (vLLM without its dev-mode routes answers 404)."""
    pause_read_at: float = float("-inf")
    """When it was last asked whether it is paused (monotonic; at most every :data:`_PAUSE_READ_S`)."""

    @property
    def worker_id(self) -> WorkerId:
        return self.spec.worker_id

    @property
    def url(self) -> str:
        return self.spec.url


def _merge(
    spec: WorkerSpec, info: dict[str, Any] | None, default_block_size: int, *, source: str
) -> WorkerInfo:
    """Spec fields win over the worker's own description (``info``, read from ``source``: its
    ``/kvmesh/info``, or a stock engine's own route); missing ones get safe defaults. A description
    with a bad fact is a WorkerError naming it (the worker is kept ``down`` with that reason, and
    read again at the next health check)."""
    has_rpc = info is not None and source == INFO_PATH
    try:
        told = worker_from_info(info, spec.url, spec.worker_id, source) if info is not None else None
    except WorkerSpecError as e:
        raise WorkerError(str(e)) from None

    def pick(name: str, default: Any) -> Any:
        value = getattr(spec, name)
        if value is None and told is not None:
            value = getattr(told, name)
        return default if value is None else value

    endpoints: tuple[str, ...] = pick("kv_events_endpoints", ())
    replay: tuple[str | None, ...] = pick("kv_replay_endpoints", ())
    return WorkerInfo(
        backend=pick("backend", "openai"),
        model=pick("model", None),
        block_size=pick("block_size", default_block_size),
        dp_size=pick("dp_size", max(len(endpoints), 1)),
        kv_events_endpoints=endpoints,
        kv_replay_endpoints=replay + (None,) * (len(endpoints) - len(replay)),
        max_num_batched_tokens=pick("max_num_batched_tokens", _DEFAULT_BATCHED_TOKENS),
        total_kv_blocks=pick("total_kv_blocks", _DEFAULT_TOTAL_BLOCKS),
        priority_polarity=pick("priority_polarity", "none"),
        has_rpc=has_rpc,
        role=pick("role", "aggregated"),
        bootstrap_port=pick("bootstrap_port", None),
        prefill_profile=_profile(_timing(info or {}).get("prefill_ms")),
        tokens_api=pick("tokens_api", False),
        described_by=source if info is not None else "config",
    )


def _undescribed(why: str) -> WorkerError:
    """A worker KV routing cannot follow, and how to describe it."""
    return WorkerError(
        f"{why}; describe it in the config (block_size and kv_events_endpoints, with "
        "max_num_batched_tokens and total_kv_blocks where known) or use --router-mode round-robin"
    )


def _timing(info: dict[str, Any]) -> dict[str, Any]:
    """The ``timing_profile`` object a worker reports (``kvmesh mock --report-profile``), or {}."""
    profile = info.get("timing_profile")
    return profile if isinstance(profile, dict) else {}


def _profile(value: Any) -> tuple[float, float, float] | None:
    """A worker-reported prefill timing curve, if it is three finite non-negative numbers."""
    if (
        isinstance(value, list)
        and len(value) == 3
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1e9 for v in value)
    ):
        return (float(value[0]), float(value[1]), float(value[2]))
    return None


class WorkerRegistry:
    """Discovery, health and event subscriptions for every configured worker."""

    def __init__(
        self,
        settings: MeshSettings,
        router: KvRouter,
        forwarder: Forwarder,
        metrics: Metrics,
        rpc: WorkerRpc,
        *,
        on_change: Callable[[], None] | None = None,
        nats: NatsLink | None = None,
    ) -> None:
        self.settings = settings
        self.router = router
        self.forwarder = forwarder
        self.metrics = metrics
        self.rpc = rpc
        self.feed = EventFeed(router, rpc, metrics, spawn=self._spawn, nats=nats)
        self.on_change = on_change
        self.workers: dict[WorkerId, Worker] = {w.worker_id: Worker(w) for w in settings.workers}
        self.block_size: int | None = settings.block_size
        self.routable: frozenset[WorkerId] = frozenset()
        """Up workers that serve whole requests or the decode stage (aggregated and decode)."""
        self.prefill_routable: frozenset[WorkerId] = frozenset()
        """Up workers with role ``prefill``: when any, requests are routed in two stages."""
        self.paused: frozenset[WorkerId] = frozenset()
        """Up workers whose engine says it is paused (:meth:`_read_readiness`): passed over while
        another may serve (``Mesh.taking_requests``)."""
        self.models: list[str] = []
        self.adapters: dict[str, frozenset[WorkerId]] = {}
        """LoRA adapter name -> the up workers serving it."""
        self._tasks: list[asyncio.Task[Any]] = []
        self._admitting: set[WorkerId] = set()
        self.ready = asyncio.Event()
        cfg = settings.router
        self._need_events = cfg.router_mode == "kv" and cfg.use_kv_events

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """First discovery of every worker (concurrently), then the health loop."""
        if self._tasks:
            return
        self._tasks.append(asyncio.create_task(self._first_discovery(), name="kvmesh-discovery"))
        self._tasks.append(asyncio.create_task(self._health_loop(), name="kvmesh-health"))

    async def _first_discovery(self) -> None:
        try:
            await asyncio.gather(*(self._admit(w) for w in self.workers.values()))
        finally:
            self.ready.set()
        refused = [w for w in self.workers.values() if w.state == REFUSED]
        for w in refused:
            print(f"kvmesh: REFUSED worker {w.worker_id}: {w.reason}", file=sys.stderr, flush=True)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        await self.feed.stop()

    def _spawn(self, coro: Any) -> None:
        """A background task the registry owns (re-syncs): cancelled on stop."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.append(task)
        task.add_done_callback(self._forget_task)

    def _forget_task(self, task: asyncio.Task[Any]) -> None:
        with contextlib.suppress(ValueError):
            self._tasks.remove(task)

    # ---------------------------------------------------------------- queries
    def get(self, worker_id: WorkerId) -> Worker | None:
        return self.workers.get(worker_id)

    def is_local(self, worker_id: WorkerId) -> bool:
        return worker_id == self.settings.self_worker_id

    def described(self, ids: frozenset[WorkerId], test: Callable[[WorkerInfo], bool]) -> frozenset[WorkerId]:
        """The workers of ``ids`` whose description passes ``test`` (a path only some servers have:
        SGLang's ``/generate``, vLLM's token API)."""
        return frozenset(
            w for w in ids if (x := self.workers.get(w)) is not None and x.info is not None and test(x.info)
        )

    def engine_loads(self) -> list[tuple[WorkerId, float, float]]:
        """(worker, running, waiting) as each up worker's engine last reported them."""
        return [
            (w.worker_id, w.engine_load.running, w.engine_load.waiting)
            for w in self.workers.values()
            if w.engine_load is not None and w.state == UP
        ]

    def snapshot(self) -> list[dict[str, Any]]:
        """One row per worker for ``GET /kvmesh/workers``: state, load and indexed blocks."""
        load: dict[WorkerId, list[dict[str, Any]]] = {}
        for snap in self.router.worker_snapshot():
            wid, rank = snap.worker
            load.setdefault(wid, []).append(
                {
                    "dp_rank": rank,
                    "active_requests": snap.active_requests,
                    "active_prefill_tokens": snap.active_prefill_tokens,
                    "active_decode_blocks": snap.active_decode_blocks,
                    "indexed_blocks": snap.indexed_blocks,
                    "total_blocks": snap.total_blocks,
                    "busy": snap.busy,
                    "timing_model": snap.timing,
                    "live_conversation_blocks": snap.live_blocks,
                    "unseen_requests": round(snap.unseen_requests, 3),
                    "decode_seconds": None if snap.decode_s is None else round(snap.decode_s, 4),
                    "stay_seconds": None if snap.in_system_s is None else round(snap.in_system_s, 4),
                }
            )
        rows = []
        now = time.monotonic()
        for w in self.workers.values():
            info = w.info
            ranks = load.get(w.worker_id, [])
            rows.append(
                {
                    "worker_id": w.worker_id,
                    "url": w.url,
                    "state": w.state,
                    "reason": w.reason,
                    "paused": w.paused,
                    "local": self.is_local(w.worker_id),
                    "state_for_s": round(now - w.since, 3),
                    "backend": info.backend if info else None,
                    "model": info.model if info else None,
                    "block_size": info.block_size if info else None,
                    "dp_size": info.dp_size if info else None,
                    "priority_polarity": info.priority_polarity if info else None,
                    "role": info.role if info else w.spec.role,
                    "tokens_api": info.tokens_api if info else None,
                    "described_by": info.described_by if info else None,
                    "lora_adapters": sorted(w.adapters),
                    # (where the router follows its KV events: told, configured or discovered)
                    "kv_events_endpoints": list(info.kv_events_endpoints) if info else [],
                    "events_applied": self.feed.events_applied(w.worker_id),
                    "events": self.feed.status(w.worker_id),
                    "active_requests": sum(r["active_requests"] for r in ranks),
                    "indexed_blocks": sum(r["indexed_blocks"] for r in ranks),
                    "ranks": ranks,
                    "engine_load": _engine_load_row(w.engine_load, now),
                }
            )
        return rows

    # ---------------------------------------------------------------- state changes
    def _set_state(self, w: Worker, state: str, reason: str | None = None) -> None:
        if w.state != state:
            w.since = time.monotonic()
            self.metrics.worker_state_changes.labels(state).inc()
            log = logger.error if state == REFUSED else logger.warning if state == DOWN else logger.info
            log("worker %s is %s%s", w.worker_id, state, f": {reason}" if reason else "")
        w.state = state
        w.reason = reason
        self._refresh_views()

    def _refresh_views(self) -> None:
        up = [x for x in self.workers.values() if x.state == UP]
        self.routable = frozenset(x.worker_id for x in up if x.info is None or x.info.role != "prefill")
        self.prefill_routable = frozenset(
            x.worker_id for x in up if x.info is not None and x.info.role == "prefill"
        )
        self.models = sorted({x.info.model for x in up if x.info and x.info.model})
        adapters: dict[str, set[WorkerId]] = {}
        for x in up:
            for name in x.adapters:
                adapters.setdefault(name, set()).add(x.worker_id)
        self.adapters = {name: frozenset(ids) for name, ids in adapters.items()}
        if self.on_change is not None:
            self.on_change()

    def lora_of(self, model: Any) -> str | None:
        """The adapter name when ``model`` (a request's "model") names a LoRA adapter."""
        return model if isinstance(model, str) and model in self.adapters else None

    # ---------------------------------------------------------------- runtime admin
    async def add(self, spec: WorkerSpec) -> Worker:
        """Register a worker at runtime and admit it now; WorkerConflict if it clashes.

        A worker that does not answer yet stays registered (down) and is admitted when it does."""
        if spec.worker_id in self.workers:
            raise WorkerConflict(f"worker id {spec.worker_id!r} is already registered")
        same_url = next((w.worker_id for w in self.workers.values() if w.url == spec.url), None)
        if same_url is not None:
            raise WorkerConflict(f"worker {spec.url} is already registered as {same_url!r}")
        if spec.block_size is not None and self.block_size is not None and spec.block_size != self.block_size:
            raise WorkerConflict(
                f"block size {spec.block_size} differs from the fleet's {self.block_size}; "
                "KV hashes would never match"
            )
        w = self.workers[spec.worker_id] = Worker(spec)
        await self._admit(w)
        if w.state == REFUSED:
            self.workers.pop(spec.worker_id, None)
            self._refresh_views()
            raise WorkerConflict(w.reason or "refused")
        return w

    async def remove(self, worker_id: WorkerId) -> bool:
        """Forget a worker: out of routing, its index blocks and load dropped, events unfollowed."""
        w = self.workers.pop(worker_id, None)
        if w is None:
            return False
        self.router.remove_worker(worker_id)
        await self.feed.unfollow(worker_id)
        self.metrics.forget_worker(worker_id)
        self.paused = self.paused - {worker_id}
        self._refresh_views()
        logger.info("worker %s removed", worker_id)
        return True

    def _current(self, w: Worker) -> bool:
        """False once ``w`` was removed (an admission in flight must not bring it back)."""
        return self.workers.get(w.worker_id) is w

    async def mark_down(self, worker_id: WorkerId, reason: str) -> None:
        """Take a worker out of routing now (a forward found it unreachable)."""
        w = self.workers.get(worker_id)
        if w is None or w.state != UP or self.is_local(worker_id):
            return
        self.router.remove_worker(worker_id)
        self._set_state(w, DOWN, reason)
        self._set_paused(w, False)  # (read again once it is up: perhaps a restarted engine, with the route)
        w.reads_pause = True
        await self.feed.unfollow(worker_id)

    async def _admit(self, w: Worker) -> None:
        """Discover, check, register, cold-start and subscribe one worker."""
        if w.worker_id in self._admitting:
            return
        self._admitting.add(w.worker_id)
        try:
            await self._admit_once(w)
        except KvMeshError as e:
            if w.state != REFUSED:
                self._set_state(w, DOWN, str(e))
        except Exception as e:  # a fault nothing above foresaw: kept visible, and tried again
            # (Two workers that described themselves oddly stayed `pending` for good, with no
            # reason anywhere, until their answers were read by rule.)
            logger.exception("worker %s: admission failed", w.worker_id)
            if w.state != REFUSED:
                self._set_state(w, DOWN, f"admission failed: {e!r}")
        finally:
            self._admitting.discard(w.worker_id)

    async def _admit_once(self, w: Worker) -> None:
        spec = w.spec
        raw: dict[str, Any] | None = None
        found: tuple[dict[str, Any], str] | None = None
        if not spec.described or self._need_events:
            try:
                raw = await self.rpc.info(w.worker_id, w.url)
            except ConnectFailed as e:
                if self._need_events and not spec.described:
                    found = await self._discover(w, e)
                elif not (spec.described or self._need_events or self.is_local(w.worker_id)):
                    # A plain OpenAI server is enough here, but it must answer.
                    await self._probe(w)
        if not self._current(w):
            return
        facts, source = found or (raw if isinstance(raw, dict) else None, INFO_PATH)
        info = _merge(spec, facts, self.block_size or 16, source=source)
        if self.block_size is None:
            self.block_size = info.block_size
        elif info.block_size != self.block_size:
            w.info = info
            self._set_state(
                w,
                REFUSED,
                f"block size {info.block_size} differs from the fleet's {self.block_size}; "
                "KV hashes would never match",
            )
            return
        if self._need_events and not info.kv_events_endpoints:
            raise WorkerError("publishes no KV events (kv_events_endpoints is empty)")
        w.info = info
        self.router.add_worker(
            w.worker_id,
            dp_size=info.dp_size,
            total_blocks=info.total_kv_blocks,
            max_num_batched_tokens=info.max_num_batched_tokens,
            block_size=info.block_size,
            profile=Profile.from_info(raw.get("timing_profile")) if isinstance(raw, dict) else None,
        )
        await self._read_adapters(w, raw if isinstance(raw, dict) else None)
        if self._need_events:
            await self.feed.follow(_feed_target(w, info), lambda: self._current(w))
        if not self._current(w):
            self.router.remove_worker(w.worker_id)
            await self.feed.unfollow(w.worker_id)
            return
        w.failures = 0
        self._set_state(w, UP)

    async def _discover(self, w: Worker, no_info: ConnectFailed) -> tuple[dict[str, Any], str] | None:
        """(the facts, the route they came from) of a worker without ``/kvmesh/info``, read on its
        engine's own routes (:func:`~kvmesh.router.mesh.engine_discovery.read_stock_engine`); None
        when they describe nothing but its entry gives what KV routing needs (its block size and
        event endpoints: a trtllm-serve followed through ``kvmesh events trtllm``, say), the rest
        kept at the router's defaults; else a WorkerError saying what to give."""
        if not isinstance(no_info, Refused) or no_info.status != 404:
            # (no HTTP at all, or a refusal of us: nothing more to read)
            raise _undescribed(f"no /kvmesh/info ({no_info})")

        try:
            found, source = await self._read_stock(w)
        except NotDiscovered as e:
            if w.spec.block_size is not None and w.spec.kv_events_endpoints:
                return None
            if isinstance(e, NoRoutes):
                raise _undescribed(f"no /kvmesh/info, {e}") from None
            raise WorkerError(str(e)) from None
        if "block_size" not in found and w.spec.block_size is None:
            raise WorkerError(
                "a vLLM without kvmesh's plugin whose /metrics has no vllm:cache_config_info to read "
                "its block size from (is --disable-log-stats on?); give block_size in its config entry"
            )
        return found, source

    async def _read_stock(self, w: Worker) -> tuple[dict[str, Any], str]:
        """What the worker's engine says of itself on its own routes (NotDiscovered if nothing)."""

        async def get(path: str) -> tuple[int, bytes]:
            try:
                return await self.forwarder.get(w.url + path, timeout=self.rpc.timeout, limit=METRICS_LIMIT)
            except ConnectFailed as e:
                return 0, str(e).encode()

        return await read_stock_engine(get, w.url)

    async def _recheck_description(self, w: Worker, raw_info: dict[str, Any] | None) -> None:
        """Read an up worker's description again (every few health checks) and take it down when
        what the router follows has changed: its event endpoints, block size or DP ranks. An engine
        restarted between two checks (on ports the OS chose, or with another config) was followed
        at its old endpoints, hearing nothing, for as long as it answered; it is admitted again,
        with what it says now, at the next check."""
        info = w.info
        if (
            info is None
            or not self._need_events
            or info.described_by == "config"
            or self.is_local(w.worker_id)
        ):
            return
        try:
            if info.described_by == INFO_PATH:
                if raw_info is None:
                    return  # (not read this time: nothing to compare)
                facts, source = raw_info, INFO_PATH
            else:
                facts, source = await self._read_stock(w)
            now = _merge(w.spec, facts, info.block_size, source=source)
        except NoRoutes:
            return  # (a route that did not answer this time: the health checks judge the worker)
        except NotDiscovered as e:  # (it answers, and says something the router cannot follow)
            await self.mark_down(w.worker_id, f"its own routes no longer describe it: {e}")
            return
        except WorkerError as e:
            await self.mark_down(w.worker_id, str(e))
            return
        before = (info.kv_events_endpoints, info.kv_replay_endpoints, info.block_size, info.dp_size)
        after = (now.kv_events_endpoints, now.kv_replay_endpoints, now.block_size, now.dp_size)
        if after != before:
            await self.mark_down(
                w.worker_id,
                f"its description changed (events {list(before[0])} -> {list(after[0])}, block size "
                f"{before[2]} -> {after[2]}, DP ranks {before[3]} -> {after[3]}); read again at the next check",
            )

    async def _read_adapters(self, w: Worker, raw_info: dict[str, Any] | None) -> None:
        """``lora_adapters`` from the worker's info, else its ``/v1/models`` entries with a parent."""
        listed = raw_info.get("lora_adapters") if raw_info is not None else None
        names: set[str] = set()
        if isinstance(listed, list):
            names = {a for a in listed if isinstance(a, str) and a}
        else:
            try:
                doc = await self.rpc.models(w.worker_id, w.url)
            except ConnectFailed:
                doc = None
            data = doc.get("data") if isinstance(doc, dict) else None
            for entry in data if isinstance(data, list) else ():
                if not isinstance(entry, dict):
                    continue
                name, parent = entry.get("id"), entry.get("parent")
                # vLLM lists an adapter with its base model as "parent"; base models have none.
                if isinstance(name, str) and isinstance(parent, str) and parent and parent != name:
                    names.add(name)
        if frozenset(names) != w.adapters:
            w.adapters = frozenset(names)
            if w.state == UP:
                self._refresh_views()

    # ---------------------------------------------------------------- health
    async def _health_loop(self) -> None:
        await self.ready.wait()
        interval = self.settings.health_interval
        failing: dict[WorkerId, str] = {}
        while True:
            await asyncio.sleep(interval)
            workers = list(self.workers.values())
            results = await asyncio.gather(*(self._check(w) for w in workers), return_exceptions=True)
            for gone in [k for k in failing if k not in self.workers]:
                del failing[gone]
            for w, result in zip(workers, results, strict=True):
                if not isinstance(result, Exception):
                    failing.pop(w.worker_id, None)
                elif failing.get(w.worker_id) != repr(result):  # once per fault, not every check
                    failing[w.worker_id] = repr(result)
                    logger.error(
                        "worker %s: a health check failed (%r); the next ones go on",
                        w.worker_id,
                        result,
                        exc_info=result,
                    )

    async def _check(self, w: Worker) -> None:
        if self.is_local(w.worker_id):
            if w.state != UP and w.state != REFUSED:
                await self._admit(w)
            elif w.state == UP:
                await self._routine(w)
                await self._read_engine_load(w)
                await self._read_readiness(w)
            return
        if w.state == REFUSED:
            return
        try:
            await self._probe(w)
        except ConnectFailed as e:
            w.failures += 1
            if w.state == UP and w.failures >= self.settings.health_failures:
                await self.mark_down(w.worker_id, f"health check failed: {e}")
            return
        w.failures = 0
        if w.state != UP:
            await self._admit(w)
        else:
            await self._routine(w)
            await self._read_engine_load(w)
            await self._read_readiness(w)

    async def _read_readiness(self, w: Worker) -> None:
        """Whether an up engine is paused now. A paused SGLang (``/pause_generation``, around a
        weight update) answers its health checks and holds every request it is sent until
        ``/continue_generation``, refusing none, so no answer tells the router; nor does a sleeping
        vLLM or one paused in ``keep`` mode, which queue what they are sent. Such a worker is
        passed over while another may serve (its cache and its sessions are kept), and routed to
        again once its engine says it has resumed. An engine without the route is not asked again."""
        info = w.info
        path = _PAUSE_READS.get(info.backend) if info is not None else None
        now = time.monotonic()
        if path is None or not w.reads_pause or now - w.pause_read_at < _PAUSE_READ_S:
            return
        w.pause_read_at = now
        try:
            status, body = await self.rpc.engine_get(w.worker_id, w.url, path)
        except ConnectFailed:
            return  # (the health checks judge the worker)
        if status in (404, 405):
            w.reads_pause = False
            self._set_paused(w, False)
            return
        paused = _pause_said(path, status, body)
        if paused is not None:
            self._set_paused(w, paused)

    async def read_pauses_now(self, worker_ids: Iterable[WorkerId]) -> None:
        """Ask these up workers' engines at once whether they are paused, not at their next health
        check: a pause or a resume just went through this router (``PAUSE_CALLS``), and until the
        check, up to a health interval later, requests went to an engine that would hold them, or
        went elsewhere once it had resumed."""
        up = [w for i in worker_ids if (w := self.workers.get(i)) is not None and w.state == UP]
        for w in up:
            w.pause_read_at = -math.inf
        await asyncio.gather(*(self._read_readiness(w) for w in up), return_exceptions=True)

    def _set_paused(self, w: Worker, paused: bool) -> None:
        if w.paused == paused:
            return
        w.paused = paused
        self.paused = frozenset(x.worker_id for x in self.workers.values() if x.paused)
        if paused:
            logger.warning(
                "worker %s: its engine says it is paused; passed over while another worker may serve",
                w.worker_id,
            )
        else:
            logger.info("worker %s: its engine takes requests again", w.worker_id)

    async def _read_engine_load(self, w: Worker) -> None:
        """The engine's own running / waiting counts (a worker without them is asked again only
        every few checks, so a plain server costs one 404 now and then)."""
        if w.metrics_misses >= 2 and w.checks % _ADAPTER_REFRESH_CHECKS:
            return
        load = None
        with contextlib.suppress(ConnectFailed):
            load = parse_engine_load(await self.rpc.metrics_text(w.worker_id, w.url), time.monotonic())
        if load is None:
            w.metrics_misses += 1
            w.engine_load = None
            self.router.engine_load(w.worker_id, 0.0, 0.0, time.monotonic())
        else:
            w.metrics_misses = 0
            w.engine_load = load
            self.router.engine_load(w.worker_id, load.running, load.waiting, load.at, load.ranks)

    async def _routine(self, w: Worker) -> None:
        """What an up worker gets at each health check besides the probe."""
        w.checks += 1
        if w.info is not None and w.worker_id in self.feed.streams:
            await self.feed.check_quiet_streams(_feed_target(w, w.info))
        if w.checks % _ADAPTER_REFRESH_CHECKS == 0:
            raw = await self.reread_adapters(w)
            await self._recheck_description(w, raw)

    async def reread_adapters(self, w: Worker) -> dict[str, Any] | None:
        """Read again which LoRA adapters an up worker serves (at every few health checks, and at
        once after the router loaded or unloaded one on it); the ``/kvmesh/info`` answer it read."""
        if w.info is None:
            return None
        raw = None
        if w.info.has_rpc:
            with contextlib.suppress(ConnectFailed):
                raw = await self.rpc.info(w.worker_id, w.url)
        info = raw if isinstance(raw, dict) else None
        await self._read_adapters(w, info)
        return info

    async def _probe(self, w: Worker) -> None:
        """Alive = answers HTTP at all (a 404 on /health from a plain server is still alive)."""
        status = await self.forwarder.status(w.url + "/health", timeout=self.settings.connect_timeout)
        if status >= 500:
            raise ConnectFailed(w.url, f"/health answered HTTP {status}")

    def rpc_target(self, worker_id: WorkerId) -> Worker | None:
        """The worker to send a kvmesh RPC (session_control, pin_prefix) to, if it serves them."""
        w = self.workers.get(worker_id)
        if w is None or w.info is None or not w.info.has_rpc:
            return None
        return w


def _pause_said(path: str, status: int, body: bytes) -> bool | None:
    """Whether the answer to ``GET path`` says the engine is paused; None when it says nothing."""
    if path == "/ready":
        return True if status == 503 else False if status == 200 else None
    if status != 200:
        return None
    try:
        said = json.loads(body)
    except ValueError:
        return None
    paused = said.get("is_paused") if isinstance(said, dict) else None
    return paused if isinstance(paused, bool) else None


def _engine_load_row(load: EngineLoad | None, now: float) -> dict[str, Any] | None:
    """The engine's own counts beside the router's estimate, with their age in seconds, and per DP
    rank where the engine labels them."""
    if load is None:
        return None
    row: dict[str, Any] = {"running": load.running, "waiting": load.waiting, "age_s": round(now - load.at, 3)}
    if load.ranks is not None:
        row["ranks"] = {
            str(r): {"running": run, "waiting": wait} for r, (run, wait) in sorted(load.ranks.items())
        }
    return row


def _feed_target(w: Worker, info: WorkerInfo) -> FeedTarget:
    return FeedTarget(w.worker_id, w.url, info.kv_events_endpoints, info.kv_replay_endpoints, info.has_rpc)
