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
import dataclasses
import functools
import heapq
import itertools
import logging
import os
import random
import socket
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

from kvmesh._native import summary as native_summary
from kvmesh._types import WorkerId, WorkerKey
from kvmesh.errors import ConfigError
from kvmesh.events.nats_link import NatsLink
from kvmesh.router.core.kv_router import KvRouter
from kvmesh.router.core.route_types import Decision, TimingSample
from kvmesh.router.mesh.event_plane import NatsDiscovery, SelfAnnouncement
from kvmesh.router.mesh.holder_search import HolderSearch
from kvmesh.router.mesh.metrics import PIN_OUTCOMES, GaugeSource, WorkerRow, get_metrics
from kvmesh.router.mesh.registry import WorkerRegistry
from kvmesh.router.mesh.replica_sync import ReplicaSync
from kvmesh.router.mesh.settings import MeshSettings
from kvmesh.router.mesh.worker_rpc import ADMIN_TOKEN_HEADER, WorkerRpc
from kvmesh.router.request.continuation import TurnMemo
from kvmesh.router.request.nvext import NvextLimits
from kvmesh.router.request.pending import PendingCounts
from kvmesh.router.request.responses_api import ResponseHomes
from kvmesh.router.request.tokenizer import BuiltinTokenizer, HfTokenizer, Tokenizer
from kvmesh.router.upstream.forwarder import ConnectFailed, Forwarder

logger = logging.getLogger("kvmesh.router")
_ROUTER_NUMBERS = itertools.count()
"""Numbers this process's routers, for their replica names."""

ASGIApp = Any
_HOUSEKEEPING_INTERVAL = 0.25
# Exponential moving average weight of one request in the reported/predicted cached-token ratio.
_RATIO_ALPHA = 0.05
ROUTER_PATH = "/kvmesh/router"
DECISIONS_PATH = "/kvmesh/decisions"
# A worker that does not answer GET /kvmesh/router (no middleware) is asked again after this long.
_PEER_RETRY_SECS = 30.0


TOKENS_PER_BYTE = 0.3
"""Prompt tokens per byte of an OpenAI body before any has been tokenized (English text runs at
3-4 characters a token; a body adds its JSON around it)."""
TOKENS_PER_BYTE_WEIGHT = 0.05
"""Weight of each tokenized prompt in ``Mesh.tokens_per_byte`` (the last few dozen bodies)."""


def load_tokenizer(name: str, engine_tokenizer: Tokenizer | None) -> Tokenizer:
    """``builtin`` | ``engine`` (the embedding engine's own) | a local Hugging Face path."""
    if engine_tokenizer is not None and name in ("engine", "builtin"):
        return engine_tokenizer if name == "engine" else BuiltinTokenizer()
    if name == "builtin":
        return BuiltinTokenizer()
    if name == "engine":
        raise ConfigError("KVMESH_TOKENIZER=engine, but the engine passed no tokenizer to the middleware")
    what = f"the tokenizer {name!r} (--tokenizer, KVMESH_TOKENIZER)"
    if not os.path.exists(name):
        raise ConfigError(f"{what} is neither 'builtin' nor an existing local path")
    # (Raised as they came, these reached `kvmesh router`'s user as a traceback.)
    try:
        return HfTokenizer(name)
    except ImportError as e:
        raise ConfigError(f"{what}: {e}") from None
    except (OSError, ValueError) as e:  # transformers' words for a directory with no tokenizer in it
        raise ConfigError(f"{what} could not be loaded: {e}") from None


REFUSAL_HOLD_S = 1.0
"""Seconds a worker that refused a request for now is passed over (:meth:`Mesh.refused`): a paused
engine then costs one refused request a second, not one per request whose best worker it is."""


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
        # (numbered, not named by the object's address: two routers alive in one process had
        # the same low bits of theirs, one replica name, and an exposition OpenMetrics refused)
        self.replica = settings.self_worker_id or (
            f"router-{socket.gethostname()}-{os.getpid()}-{next(_ROUTER_NUMBERS)}"
        )
        nats_options = settings.nats_options
        # --event-plane nats://...: one connection carries KV events, replica sync and discovery.
        self.nats = NatsLink(nats_options, name=f"kvmesh-router {self.replica}") if nats_options else None
        self.registry = WorkerRegistry(
            settings, self.router, self.forwarder, self.metrics, self.rpc, nats=self.nats
        )
        self.discovery = (
            NatsDiscovery(self.nats, self.registry, ttl=settings.nats_worker_ttl) if self.nats else None
        )
        # Embedded in an engine on the NATS plane: register that engine in the worker bucket.
        self.announcement = (
            SelfAnnouncement(
                self.nats, self.rpc, settings.self_worker_id, settings.self_url, ttl=settings.nats_worker_ttl
            )
            if self.nats is not None and settings.self_url is not None and settings.self_worker_id is not None
            else None
        )
        # A random per-process epoch makes request ids unique across restarts and replicas: peers
        # key their copy of our load by them.
        self.epoch = int.from_bytes(os.urandom(4), "big")
        self._id_prefix = f"{self.replica}-{self.epoch:08x}-"
        self.kv_mode = self.config.router_mode == "kv"
        self.tokens_per_byte = TOKENS_PER_BYTE
        """Prompt tokens per byte of request body, learned from the prompts tokenized: the length
        of a prompt routed before its tokens are known (``DeferredPrompt``)."""
        self.background_copies = self.config.router_background_copies
        """Copies of a hot prefix are made by the router's own prefill (``--router-background-copies``),
        until the engines refuse them (``kvmesh.router.asgi.prefix_copy``)."""
        self.copies_refused = 0
        """Background copies refused in a row by the engines (HTTP 4xx)."""
        self.deferred_prompts = 0
        """Prompts routed on their first block alone (no worker held it) and tokenized once sent."""
        self.turn_memo = TurnMemo()
        """Recent chat prompts' blocks: a conversation's later turn is routed on its earlier one's."""
        self.response_homes = ResponseHomes()
        """Where each stored Responses API answer was served (``previous_response_id``)."""
        self.refusing: dict[str, float] = {}
        """Workers that refused a request for now (a paused engine), and until when (monotonic)
        they are passed over: :meth:`refused`, :meth:`taking_requests`."""
        self.session_homes = ResponseHomes()
        """Where each SageMaker stateful session was opened (its engine alone holds it, as one
        holds a stored response): ``kvmesh.router.asgi.invocations``."""
        self.sglang_session_homes = ResponseHomes()
        """Where each SGLang session was opened through this router (``/open_session``; its
        engine alone holds its history): ``kvmesh.router.asgi.sglang_sessions``."""
        self.log_requests = settings.log_requests
        """Log a line per request (``--log-requests``), read on every request's end."""
        self.holder_search = HolderSearch()
        """Searches of the fleet for the engine holding a response or a session this router was not
        told of: one per id at a time, a miss remembered for a moment."""
        self.cold_counts = PendingCounts()
        """Prompts routed on a first block no worker held, sent and not yet counted, by that
        block's hash (:meth:`held_first`)."""
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
                nats=self.nats,
                secret=settings.mesh_secret,
            )
            for kind, homes in (
                ("response", self.response_homes),
                ("sagemaker_session", self.session_homes),
                ("sglang_session", self.sglang_session_homes),
            ):  # (what one replica learns of them, every replica knows)
                homes.on_change = functools.partial(self.sync.home, kind)
                self.sync.homes[kind] = homes
            if not settings.mesh_secret:
                logger.warning(
                    "kvmesh: replica sync without a mesh secret (KVMESH_MESH_SECRET): anything that "
                    "reaches the sync socket is taken for a replica%s (docs/security.md)",
                    ""
                    if settings.self_worker_id is None
                    else ", and requests forwarded to this engine cannot be proven to come from one, "
                    "so they count in this replica's load view twice until they end",
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
        self.pin_stats: dict[WorkerId, dict[str, Any]] = {}
        """cache_control pins per worker: counts by outcome and the last refusal (``/kvmesh/workers``)."""
        self._warmups: dict[str, tuple[tuple[int, ...], asyncio.Task[Any]]] = {}
        self.metrics.track(
            self,
            GaugeSource(
                self.replica,
                self._worker_rows,
                lambda: self.router.queue_pending,
                self._live_ratios,
                self._plane_connected,
                self.registry.engine_loads,
                self._sync_counts,
                lambda: self._started,
                self._search_counts,
            ),
        )

    # ---------------------------------------------------------------- lifecycle
    async def ensure_started(self) -> None:
        if self._started:
            return
        self._started = True
        if self.nats is not None:
            self.nats.start()
            # A short wait lets the first discovery use the plane; NATS being away delays nothing more.
            await self.nats.wait_connected(min(self.settings.connect_timeout, 2.0))
        if self.sync is not None:
            self.sync.start()
            for endpoint in self.settings.sync_peers:
                self.sync.follow(endpoint)
            if self.nats is None:  # on NATS every replica listens on one subject: nothing to find
                self._discovery = asyncio.create_task(self._discover_peers(), name="kvmesh-sync-discovery")
        await self.registry.start()
        if self.discovery is not None:
            self.discovery.start()
        if self.announcement is not None:
            self.announcement.start()
        self._housekeeping = asyncio.create_task(self._housekeep(), name="kvmesh-housekeeping")

    async def wait_ready(self) -> None:
        ready = self.registry.ready
        if not ready.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(ready.wait(), self.settings.connect_timeout + 2.0)

    def refused(self, worker_id: str) -> None:
        """``worker_id`` refused a request for now: pass it over for :data:`REFUSAL_HOLD_S`. A paused
        engine answers its health checks, so only its refusals tell; without the hold, every request
        whose best worker it is would be sent there first and refused."""
        self.refusing[worker_id] = time.monotonic() + REFUSAL_HOLD_S

    def taking_requests(self, allowed: frozenset[str]) -> frozenset[str]:
        """``allowed`` without the workers that refused a request within the hold and those whose
        engine says it is paused (``registry.paused``), unless that would leave none (then the
        request is asked of them anyway: one may have resumed, and a paused SGLang holds it)."""
        now = time.monotonic()
        for worker_id, until in list(self.refusing.items()):
            if until <= now:
                del self.refusing[worker_id]
        left = allowed.difference(self.refusing).difference(self.registry.paused)
        return left if left else allowed

    def held_first(self, block_hash: int) -> bool:
        """Whether a worker holds, or a request in flight carries, a prompt's first block. A prompt
        sent with that first block and not yet counted is counted first: a request that begins with
        it (a sibling sharing its context) is then routed on all of its blocks, beside it."""
        self.cold_counts.settle(block_hash)
        return self.router.holds_any(block_hash)

    def learn_tokens_per_byte(self, tokens: int, body_bytes: int) -> None:
        """A prompt of ``tokens`` came in a body of ``body_bytes``."""
        if tokens > 0 and body_bytes > 0:
            self.tokens_per_byte += TOKENS_PER_BYTE_WEIGHT * (tokens / body_bytes - self.tokens_per_byte)

    async def stop(self) -> None:
        for task in (self._housekeeping, self._discovery):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._housekeeping = self._discovery = None
        for task in list(self._spawned):
            task.cancel()
        if self.announcement is not None:
            await self.announcement.stop()
        if self.discovery is not None:
            await self.discovery.stop()
        for _, task in list(self._warmups.values()):
            task.cancel()
        if self.sync is not None:
            await self.sync.stop()
        await self.registry.stop()
        if self.nats is not None:
            await self.nats.close()
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
            "cost_model": self.config.router_cost_model,
            "compiled": native_summary(),  # (kvmesh native build: the decisions' own code, C or Python)
            "prefill_load_model": self.config.router_prefill_load_model,
            "timing_models": {
                f"{s.worker[0]}/{s.worker[1]}": s.timing for s in self.router.worker_snapshot() if s.timing
            },
            "conversations": self.router.conversation_stats(),
            "shared_prefixes": self.router.shared_prefix_stats(),
            "steps_joined": self.router.join_stats(),
            "decode_pass_lag": self.router.pass_lag_stats(),
            "routed_on_first_block": {
                "prompts": self.deferred_prompts,
                "tokens_per_byte": round(self.tokens_per_byte, 4),
            },
            "routed_on_earlier_turn": self.turn_memo.describe(),
            "memory_waits": self.router.memory_wait_stats(),
            "ttft_tail": self.router.ttft_tail_stats(),
            "replica_sync": sync is not None,
            "router_sync_endpoint": sync.endpoint if sync is not None else None,
            **({"sync": sync.describe()} if sync is not None else {}),
            "event_plane": self.event_plane_status(),
        }

    def describe_decisions(self, limit: int) -> dict[str, Any]:
        """``GET /kvmesh/decisions``: the last ``limit`` decisions, newest first, each with every
        candidate's numbers (the latency cost's terms in ms), so a placement can be explained: why
        a sibling stayed behind its twin's prefill, why a turn left its history."""
        now = time.monotonic()
        return {
            "replica": self.replica,
            "cost_model": self.config.router_cost_model,
            "block_size": self.registry.block_size,
            "decisions": [_decision_doc(d, now - at) for at, d in self.router.recent_decisions(limit)],
        }

    def event_plane_status(self) -> dict[str, Any]:
        """``{"kind": "zmq"}``, or the NATS connection's state and the workers found through it."""
        if self.nats is None:
            return {"kind": "zmq"}
        status = self.nats.describe()
        if self.discovery is not None:
            status.update(self.discovery.describe())
        if status.get("stream_problem"):
            status["note"] = (
                "NATS answers, but the event stream is not ready (stream_problem): routing on the "
                "last known state; retrying"
            )
        elif not status["connected"]:
            status["note"] = "NATS unreachable: routing on the last known state; re-syncs on reconnection"
        return status

    def _search_counts(self) -> Iterator[tuple[str, str, int]]:
        for kind, counts in self.holder_search.counts.items():
            for outcome, n in dataclasses.asdict(counts).items():
                yield kind, outcome, n

    def _sync_counts(self) -> tuple[dict[str, int], int] | None:
        sync = self.sync
        return None if sync is None else (dataclasses.asdict(sync.stats), sync.peers_heard)

    def _plane_connected(self) -> tuple[str, float]:
        if self.nats is None:
            return "zmq", 1.0
        return "nats", 1.0 if self.nats.connected else 0.0

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

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        """Fire-and-forget a worker RPC; failures are logged, never raised at a request. The task
        is kept in a set until it ends (the event loop holds tasks only weakly) and cancelled on
        stop."""
        task = asyncio.get_running_loop().create_task(coro)
        self._spawned.add(task)
        task.add_done_callback(self._spawned.discard)
        task.add_done_callback(_log_failure)
        return task

    def record_ttft_prediction(self, sample: TimingSample) -> None:
        """The latency cost's prediction for a finished request beside what happened."""
        worker = sample.worker[0]
        m = self.metrics
        m.ttft_predicted.labels(worker).observe(sample.predicted_s)
        m.ttft_observed.labels(worker).observe(sample.observed_s)
        if sample.predicted_s > 0:
            m.ttft_prediction_ratio.labels(worker).observe(sample.observed_s / sample.predicted_s)

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

    async def pin_answer(self, worker_id: WorkerId, token_ids: list[int], ttl_seconds: float) -> None:
        """A ``cache_control`` pin after the response: prompt + answer on the worker that served
        it. What the worker could not take (not cached, over its budget, no RPCs) is counted, per
        worker, in metrics and ``/kvmesh/workers``; it is never raised at anyone."""
        block_size = self.registry.block_size or 16
        # the answer's last token was sampled, never fed back: its KV (and a block it would
        # complete) is not in the engine's cache
        wanted = (len(token_ids) - 1) // block_size
        stats = self.pin_stats.setdefault(
            worker_id, {**dict.fromkeys(PIN_OUTCOMES, 0), "blocks_pinned": 0, "last_error": None}
        )
        error: str | None = None
        pinned = 0
        if self.registry.rpc_target(worker_id) is None:
            error = "the worker serves no kvmesh RPCs (pin_prefix)"
        else:
            try:
                answer = await self.pin_prefix(worker_id, token_ids, ttl_seconds)
            except ConnectFailed as e:
                error = str(e)
            else:
                got = answer.get("blocks_pinned") if isinstance(answer, dict) else None
                pinned = got if isinstance(got, int) and not isinstance(got, bool) else 0
        outcome = "failed" if error is not None else ("pinned" if pinned >= wanted else "partial")
        if outcome == "partial":
            error = f"pinned {pinned} of {wanted} blocks"
        stats[outcome] += 1
        stats["blocks_pinned"] += pinned
        if error is not None:
            stats["last_error"] = error
        self.metrics.pins.labels(worker_id, outcome).inc()
        if pinned:
            self.metrics.pinned_blocks.labels(worker_id).inc(pinned)

    # ---------------------------------------------------------------- speculative prefill
    def start_warmup(
        self,
        request_id: str,
        worker: WorkerKey,
        endpoint: str,
        body: dict[str, Any],
        headers: dict[str, str],
        prefix: tuple[int, ...],
        hashes: list[int],
        isl: int,
        overlap_blocks: int,
    ) -> str:
        """Send the next turn's prompt (``body``, ``max_tokens: 1``) to ``worker`` and wait for
        nobody: counted as load under ``request_id`` (from :meth:`next_request_id`) while it runs,
        cancelled when a request extending ``prefix`` (the turn's own block hashes) arrives first.
        ``headers`` (the hop headers for ``request_id``, signed) make a peer serve it itself."""
        self.router.track(
            request_id, worker, hashes, isl, time.monotonic(), overlap_blocks=overlap_blocks, own=True
        )
        task = asyncio.get_running_loop().create_task(
            self._warmup(request_id, worker[0], endpoint, body, headers)
        )
        self._warmups[request_id] = (prefix, task)
        return request_id

    async def _warmup(
        self,
        request_id: str,
        worker_id: WorkerId,
        endpoint: str,
        body: dict[str, Any],
        headers: dict[str, str],
    ) -> None:
        outcome = "failed"
        try:
            if await self.post_own(worker_id, endpoint, body, headers):
                outcome = "done"
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        except Exception as e:  # a warm-up nobody waits for must never surface
            logger.info("kvmesh speculative prefill on %s failed: %s", worker_id, e)
        finally:
            self._warmups.pop(request_id, None)
            now = time.monotonic()
            self.router.finished(request_id, now)
            self.metrics.speculative_prefills.labels(outcome).inc()
            self.pump(now)

    async def post_own(
        self, worker_id: WorkerId, endpoint: str, body: dict[str, Any], headers: dict[str, str]
    ) -> bool:
        """Send a request the router makes itself (a warm-up, a prefix copy) to ``worker_id`` and
        wait for its answer: in-process to the embedding engine, else over HTTP with ``headers``
        (those marking it routed already). False when the worker is no longer known; ConnectFailed
        (``Refused`` for an HTTP error) when it fails."""
        w = self.registry.get(worker_id)
        if w is None:
            return False
        bound = self.config.router_request_timeout_secs
        if self.registry.is_local(worker_id):
            await self.rpc.call(worker_id, w.url, "POST", endpoint, body, timeout=bound)
        else:
            await self.forwarder.post_json(w.url + endpoint, body, timeout=bound, headers=headers)
        return True

    def cancel_warmups(self, hashes: list[int]) -> None:
        """The next turn is here: a warm-up of a prefix it extends is of no use any more."""
        if not self._warmups or not hashes:
            return
        for prefix, task in list(self._warmups.values()):
            if len(prefix) <= len(hashes) and tuple(hashes[: len(prefix)]) == prefix:
                task.cancel()


def _log_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.warning("kvmesh worker RPC failed: %s", task.exception())


def _decision_doc(decision: Decision, age_s: float) -> dict[str, Any]:
    chosen = decision.worker
    return {
        "request_id": decision.request_id,
        "age_s": round(age_s, 3),
        "reason": decision.reason,
        "worker_id": chosen[0],
        "dp_rank": chosen[1],
        "overlap_blocks": decision.overlap_blocks,
        "queued_s": round(decision.waited, 4),
        "candidates": [
            {
                "worker_id": c.worker[0],
                "dp_rank": c.worker[1],
                "chosen": c.worker == chosen,
                "overlap_blocks": c.overlap_blocks,
                "prefill_tokens": round(c.prefill_tokens, 1),
                "decode_blocks": round(c.decode_blocks, 1),
                "cost": round(c.cost, 3),
                "predicted_ttft_ms": None if c.predicted_ttft_ms is None else round(c.predicted_ttft_ms, 2),
                "step_wait_ms": round(c.step_wait_ms, 2),
                "eviction_ms": round(c.eviction_ms, 2),
                "delay_to_others_ms": round(c.delay_to_others_ms, 2),
                "copy_credit_ms": round(c.copy_credit_ms, 2),
                "turns_overlap_ms": round(c.turns_overlap_ms, 2),
                "memory_wait_ms": round(c.memory_wait_ms, 2),
            }
            for c in decision.breakdown
        ],
    }
