"""kvmesh's ``vllm.endpoint_plugins`` entry point: the worker RPCs on vLLM's own HTTP server.

Loaded by vLLM's API server only, and only when ``VLLM_PLUGINS`` names ``kvmesh``. The routes and
their validation are the engine-agnostic ones of :mod:`kvmesh.worker.rpc` (shared with the mock
engine); this module only implements their backend for vLLM: every call becomes a vLLM *utility
call* to ``EngineCore.kvmesh_rpc`` (installed by the general plugin), once per data-parallel
engine, and the per-rank answers are merged.

``init_state`` also starts the retention clock (a task that calls ``tick`` on every engine core
so pins and idle sessions expire on time even when no RPC arrives) and warns when request
priority cannot work because vLLM runs without ``--scheduling-policy priority``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from argparse import Namespace
from collections.abc import Mapping
from typing import Any

from kvmesh.adapters.vllm.engine_rpc import RPC_METHOD
from kvmesh.errors import ConfigError, RequestError
from kvmesh.worker.advertise import advertise_host_from_env, reachable
from kvmesh.worker.block_state import kv_state_answer
from kvmesh.worker.rpc import worker_rpc_routes, worker_token_from_env

logger = logging.getLogger("kvmesh.adapters.vllm")

PLUGIN_NAME = "kvmesh"
TICK_ENV = "KVMESH_VLLM_TICK_SECONDS"
DEFAULT_TICK = 0.5
TICK_RANGE = (0.01, 60.0)
"""The retention clock's period, in seconds. (0 or less had the task call every engine core as
fast as the event loop turned; more than a minute would hold an idle session or a pin that long
past its deadline.)"""
PRIORITY_WARNING = (
    "kvmesh: vLLM runs without --scheduling-policy priority, so nvext.agent_hints.priority only "
    "orders kvmesh's own queue; vLLM serves requests first come, first served"
)


class VllmWorkerBackend:
    """kvmesh's :class:`~kvmesh.worker.rpc.WorkerBackend` over a vLLM ``EngineClient``."""

    def __init__(self, engine_client: Any, args: Namespace, *, advertise_host: str | None = None) -> None:
        self.engine_client = engine_client
        self.args = args
        self.advertise_host = advertise_host

    @property
    def priority_polarity(self) -> str:
        policy = self.engine_client.vllm_config.scheduler_config.policy
        return "lower_first" if policy == "priority" else "none"

    async def _each_rank(self, name: str, payload: dict[str, Any]) -> list[dict[str, Any]]:
        """``kvmesh_rpc(name, payload)`` on every engine core this front end drives."""
        core = self.engine_client.engine_core
        try:
            if hasattr(core, "call_utility_all_async"):
                answers = await core.call_utility_all_async(RPC_METHOD, name, payload)
            else:
                answers = [await core.call_utility_async(RPC_METHOD, name, payload)]
        except Exception as e:  # vLLM raises its own errors for a failed or refused utility call
            raise RequestError(f"vLLM engine core failed kvmesh RPC {name!r}: {e}", status=503) from e
        return list(answers)

    # ---------------------------------------------------------------- WorkerBackend
    async def info(self) -> dict[str, Any]:
        config = self.engine_client.vllm_config
        sources = self.engine_client.get_kv_event_sources()
        ranks = sorted(sources)
        return {
            "backend": "vllm",
            "model": _served_model(self.args),
            "block_size": config.cache_config.block_size,
            "dp_size": config.parallel_config.data_parallel_size,
            "kv_events_endpoints": [self._reachable(sources[r].endpoint) for r in ranks],
            "kv_replay_endpoints": [
                self._reachable(sources[r].replay_endpoint) if sources[r].replay_endpoint else None
                for r in ranks
            ],
            "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
            "total_kv_blocks": config.cache_config.num_gpu_blocks or 0,
            "priority_polarity": self.priority_polarity,
            # vLLM registers its token API (/inference/v1/generate) only when started to
            "tokens_api": bool(
                getattr(self.args, "enable_scale_out", False) or getattr(self.args, "tokens_only", False)
            ),
        }

    async def kv_state(self) -> dict[str, Any]:
        ranks = await self._each_rank("kv_state", {})
        missing = [r for r in ranks if "error" in r]
        if missing:
            raise RequestError(
                "kv_state needs kvmesh's KV-event publisher: start vLLM with "
                '--kv-events-config \'{"enable_kv_cache_events": true, "publisher": "kvmesh", ...}\'',
                status=409,
            )
        return kv_state_answer(self.engine_client.vllm_config.cache_config.block_size, ranks)

    async def pin_prefix(self, token_ids: list[int], ttl_seconds: float) -> int:
        answers = await self._each_rank("pin_prefix", {"token_ids": token_ids, "ttl_seconds": ttl_seconds})
        return sum(int(a["blocks_pinned"]) for a in answers)

    async def open_session(self, session_id: str, timeout: float) -> bool:
        answers = await self._each_rank("open_session", {"session_id": session_id, "timeout": timeout})
        return any(a["created"] for a in answers)

    async def close_session(self, session_id: str) -> bool:
        answers = await self._each_rank("close_session", {"session_id": session_id})
        return any(a["closed"] for a in answers)

    async def reset_prefix_cache(self) -> bool:
        return bool(await self.engine_client.reset_prefix_cache())

    async def tick(self) -> float | None:
        """Advance retention on every rank; the time until the earliest deadline, if any."""
        waits = [a["next_expiry_in"] for a in await self._each_rank("tick", {})]
        due = [w for w in waits if w is not None]
        return min(due) if due else None

    def _reachable(self, endpoint: str) -> str:
        """A bound wildcard endpoint (``tcp://*:5557``) as a peer can dial it."""
        return reachable(endpoint, self.advertise_host)


def _served_model(args: Namespace) -> str | None:
    names = getattr(args, "served_model_name", None)
    if names:
        return str(names[0])
    model = getattr(args, "model", None)
    return str(model) if model else None


class KvMeshEndpointPlugin:
    """vLLM's ``EndpointPlugin`` protocol: ``name``, ``required_tasks``, ``attach_router``, ``init_state``."""

    name = PLUGIN_NAME
    required_tasks = ("generate",)

    def __init__(self) -> None:
        self.backend: VllmWorkerBackend | None = None
        self._ticker: asyncio.Task[None] | None = None

    def attach_router(self, app: Any) -> None:
        routes = worker_rpc_routes(_LateBackend(self), admin_token=worker_token_from_env())
        app.router.routes.extend(routes)

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        if engine_client is None:
            return  # vLLM's render-only server: no engine, the routes answer 503
        interval = tick_seconds_from_env()  # a bad value stops the start, before anything runs
        backend = VllmWorkerBackend(engine_client, args, advertise_host=advertise_host_from_env())
        self.backend = backend
        state.kvmesh_backend = backend
        if backend.priority_polarity == "none":
            logger.warning(PRIORITY_WARNING)
        self._ticker = asyncio.get_running_loop().create_task(_run_ticker(backend, interval))

    async def stop(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            try:
                await self._ticker
            except asyncio.CancelledError:
                pass
            self._ticker = None


class _LateBackend:
    """Routes are attached before vLLM has an engine client; calls resolve the backend then."""

    def __init__(self, plugin: KvMeshEndpointPlugin) -> None:
        self._plugin = plugin

    def _backend(self) -> VllmWorkerBackend:
        if self._plugin.backend is None:
            raise RequestError("the vLLM engine is not ready", status=503)
        return self._plugin.backend

    async def info(self) -> dict[str, Any]:
        return await self._backend().info()

    async def kv_state(self) -> dict[str, Any]:
        return await self._backend().kv_state()

    async def pin_prefix(self, token_ids: list[int], ttl_seconds: float) -> int:
        return await self._backend().pin_prefix(token_ids, ttl_seconds)

    async def open_session(self, session_id: str, timeout: float) -> bool:
        return await self._backend().open_session(session_id, timeout)

    async def close_session(self, session_id: str) -> bool:
        return await self._backend().close_session(session_id)

    async def reset_prefix_cache(self) -> bool:
        return await self._backend().reset_prefix_cache()


def tick_seconds_from_env(environ: Mapping[str, str] | None = None) -> float:
    """``KVMESH_VLLM_TICK_SECONDS``, or the default; ConfigError naming it when it is no number
    in ``TICK_RANGE`` (a word was a bare ``ValueError`` from ``float`` at vLLM's start)."""
    text = (os.environ if environ is None else environ).get(TICK_ENV)
    if text is None or not text.strip():
        return DEFAULT_TICK
    low, high = TICK_RANGE
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not low <= value <= high:  # (NaN fails both)
        raise ConfigError(f"{TICK_ENV} must be a number of seconds from {low} to {high:g}, got {text!r}")
    return value


async def _run_ticker(backend: VllmWorkerBackend, interval: float) -> None:
    while True:
        try:
            wait = await backend.tick()
        except Exception as e:  # an engine restarting or shutting down: keep the clock alive
            logger.debug("kvmesh: retention tick failed: %s", e)
            wait = None
        await asyncio.sleep(interval if wait is None else min(max(wait, 0.01), interval))


def endpoint_plugin() -> KvMeshEndpointPlugin:
    """The ``vllm.endpoint_plugins`` entry point (a zero-argument factory)."""
    return KvMeshEndpointPlugin()
