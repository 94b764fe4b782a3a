"""kvmesh's ``sglang.srt.plugins`` entry point, run by SGLang's ``load_plugins()`` in every process.

SGLang calls :func:`register` once per process (main, tokenizer workers, each scheduler, the
detokenizer, the DP controller; ``SGLANG_PLUGINS`` may whitelist names) and then applies the hooks
registered meanwhile. Registration is cheap (no socket, no thread, nothing imported beyond what
SGLang itself imports) and idempotent:

1. the ``kvmesh`` KV-event publisher in ``EventPublisherFactory`` (used where the scheduler
   creates its publisher from ``--kv-events-config '{"publisher": "kvmesh", ...}'``);
2. the scheduler hooks of :mod:`.scheduler_hooks` (pins between steps, dropped on flush). They do
   nothing unless the launcher set ``KVMESH_SGLANG_CONTROL``.
"""

from __future__ import annotations

import logging
from typing import Any

from kvmesh.adapters.sglang._sglang import import_sglang
from kvmesh.adapters.sglang.publisher import PUBLISHER_NAME, KvMeshPublisher

logger = logging.getLogger("kvmesh.adapters.sglang")

SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
_hooks_registered = False


def register() -> None:
    """The ``sglang.srt.plugins`` entry point."""
    import_sglang()
    register_publisher()
    register_scheduler_hooks()


def register_publisher() -> None:
    from sglang.srt.disaggregation.kv_events import EventPublisherFactory

    registry: dict[str, Any] = EventPublisherFactory._registry
    if registry.get(PUBLISHER_NAME) is KvMeshPublisher:
        return
    if PUBLISHER_NAME in registry:  # someone else's "kvmesh": leave it, say so
        logger.warning("kvmesh: a KV-event publisher named %r is already registered", PUBLISHER_NAME)
        return
    EventPublisherFactory.register_publisher(PUBLISHER_NAME, KvMeshPublisher)


def register_scheduler_hooks() -> None:
    global _hooks_registered
    if _hooks_registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from kvmesh.adapters.sglang import scheduler_hooks

    HookRegistry.register(
        f"{SCHEDULER}.process_input_requests", scheduler_hooks.after_process_input_requests, HookType.AFTER
    )
    HookRegistry.register(f"{SCHEDULER}.flush_cache", scheduler_hooks.after_flush_cache, HookType.AFTER)
    _hooks_registered = True
