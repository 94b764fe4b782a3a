"""kvmesh's ``vllm.general_plugins`` entry point: engine-side registration, in every vLLM process.

vLLM calls :func:`register` in the API server (before it parses the command line), in each engine
core and in each worker, and may call it more than once per process; every step is idempotent.

1. Registers the ``kvmesh`` KV-event publisher with ``EventPublisherFactory``.
2. Lets ``--kv-events-config`` name it. vLLM 0.33.0 declares ``KVEventsConfig.publisher`` as
   ``Literal["null", "zmq"]`` and validates the flag with pydantic, so a registered publisher could
   otherwise only be chosen from Python. The field's accepted values are widened by one name
   and the pydantic dataclass rebuilt; everything else about the config is unchanged.
3. Installs ``EngineCore.kvmesh_rpc`` (the utility method kvmesh's HTTP routes call) and wraps
   ``EngineCore.add_request`` so open sessions see their turns (see :mod:`.engine_rpc`).
"""

from __future__ import annotations

import logging
import os
import typing
from collections.abc import Mapping
from typing import Any

from kvmesh.adapters.vllm._vllm import import_vllm
from kvmesh.adapters.vllm.engine_rpc import RPC_METHOD, kvmesh_rpc, wrap_add_request
from kvmesh.adapters.vllm.publisher import PUBLISHER_NAME, KvMeshPublisher

logger = logging.getLogger("kvmesh.adapters.vllm")


def register() -> None:
    """The ``vllm.general_plugins`` entry point."""
    import_vllm()
    check_settings()
    register_publisher()
    allow_publisher_name()
    install_engine_rpc()


def check_settings(environ: Mapping[str, str] | None = None) -> None:
    """Read kvmesh's settings now, in the API server before vLLM parses its command line:
    ConfigError naming the variable. The middleware and the endpoint plugin read them once the
    engine is up and the engine cores read the pin budget as they start, all after the model has
    loaded: a wrong ``KVMESH_WORKERS`` was said only after minutes of loading."""
    from kvmesh.adapters.vllm.endpoints import tick_seconds_from_env
    from kvmesh.router.mesh.settings import MeshSettings, mesh_configured
    from kvmesh.worker.retention import pin_budget_from_env

    env = os.environ if environ is None else environ
    pin_budget_from_env(env)
    tick_seconds_from_env(env)
    if mesh_configured(env):  # (what the middleware routes over)
        MeshSettings.load(env)


def register_publisher() -> None:
    from vllm.distributed.kv_events import EventPublisherFactory

    registry: dict[str, Any] = EventPublisherFactory._registry
    if registry.get(PUBLISHER_NAME) is not KvMeshPublisher:
        if PUBLISHER_NAME in registry:  # someone else's "kvmesh": leave it, say so
            logger.warning("kvmesh: a KV-event publisher named %r is already registered", PUBLISHER_NAME)
            return
        EventPublisherFactory.register_publisher(PUBLISHER_NAME, KvMeshPublisher)


def allow_publisher_name() -> None:
    from pydantic.dataclasses import rebuild_dataclass
    from vllm.config.kv_events import KVEventsConfig

    field = KVEventsConfig.__dataclass_fields__["publisher"]
    names = typing.get_args(field.type)
    if not names or PUBLISHER_NAME in names:
        return  # already widened, or not a Literal any more (a newer vLLM may accept any name)
    choices = (*names, PUBLISHER_NAME)  # a name, not [(*...)]: mypy reads that as 3.11-only syntax
    widened = typing.Literal[choices]  # type: ignore[valid-type]
    field.type = widened
    KVEventsConfig.__annotations__["publisher"] = widened
    rebuild_dataclass(KVEventsConfig, force=True)


def install_engine_rpc() -> None:
    from vllm.v1.engine.core import EngineCore

    if getattr(EngineCore, RPC_METHOD, None) is not kvmesh_rpc:
        setattr(EngineCore, RPC_METHOD, kvmesh_rpc)
    if not hasattr(EngineCore.add_request, "__kvmesh_wrapped__"):
        EngineCore.add_request = wrap_add_request(EngineCore.add_request)  # type: ignore[method-assign]
