"""kvmesh inside SGLang's scheduler process: serve pins between scheduler steps, drop them on flush.

Installed by the plugin through SGLang's ``HookRegistry`` (applied by ``load_plugins()``, the first
line of every scheduler process):

* AFTER ``Scheduler.process_input_requests`` (runs once per loop iteration, busy or idle, in the
  scheduler's thread): create this rank's :class:`SchedulerService` on first use, answer the
  pending control requests, expire pins whose TTL ran out;
* AFTER ``Scheduler.flush_cache``: when the flush happened (it returns True), forget every pin;
  SGLang reset the tree whatever was locked.

Only a scheduler that owns a KV-event publisher slot (pp rank 0, attention-TP rank 0) serves pins,
and only when its attention-TP size is 1: with tensor parallelism every TP rank keeps its own copy
of the radix tree, kept identical by identical scheduling; locking one copy would make them
diverge, so such a scheduler answers pins with an error instead (see docs/sglang.md).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from kvmesh.adapters.sglang.control import CONTROL_ENV, ControlServer, control_endpoint
from kvmesh.adapters.sglang.pins import RadixPins
from kvmesh.errors import RequestError
from kvmesh.worker.retention import pin_budget_from_env

logger = logging.getLogger("kvmesh.adapters.sglang")

_SERVICE_ATTR = "_kvmesh_service"


class SchedulerService:
    """The control requests of one scheduler, over its radix cache."""

    def __init__(self, pins: RadixPins | None, *, refusal: str | None = None) -> None:
        self.pins = pins
        self.refusal = refusal

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        if op == "stats":
            return self.pins.stats() if self.pins is not None else {"refused": self.refusal}
        pins = self._pins()
        if op == "pin_prefix":
            token_ids = request["token_ids"]
            pinned = pins.pin(token_ids, float(request["ttl_seconds"]), request.get("extra_key"))
            return {"blocks_pinned": pinned}
        if op == "tick":
            pins.expire()
            return {"next_expiry_in": pins.next_expiry_in()}
        raise RequestError(f"unknown kvmesh control op {op!r}")

    def _pins(self) -> RadixPins:
        if self.pins is None:
            raise RequestError(self.refusal or "pins are not available on this scheduler", status=409)
        return self.pins


def _dp_rank(scheduler: Any) -> int:
    from sglang.srt.disaggregation.kv_events import select_kv_publisher_dp_rank
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    return int(select_kv_publisher_dp_rank(parallel.attn_dp_size, parallel.attn_dp_rank, parallel.dp_rank))


def _owns_cache(scheduler: Any) -> tuple[bool, int]:
    """(whether this scheduler answers for its DP rank's cache, the attention-TP size)."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    first = parallel.pp_rank == 0 and parallel.attn_tp_rank == 0 and parallel.attn_cp_rank == 0
    return first, int(getattr(parallel, "attn_tp_size", 1) or 1)


def make_service(scheduler: Any) -> SchedulerService:
    """A service over ``scheduler.tree_cache`` (page size and capacity read from the scheduler)."""
    _, tp = _owns_cache(scheduler)
    if tp > 1:
        return SchedulerService(
            None,
            refusal=f"kvmesh pins need attention-TP size 1 (this scheduler has {tp}): every TP rank "
            "keeps its own radix tree, and locking one copy would make them diverge",
        )
    pins = RadixPins(
        scheduler.tree_cache,
        page_size=int(scheduler.page_size),
        total_tokens=int(scheduler.max_total_num_tokens),
        budget_fraction=pin_budget_from_env(),
    )
    return SchedulerService(pins)


def after_process_input_requests(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    state = scheduler.__dict__.get(_SERVICE_ATTR)
    if state is None:
        state = scheduler.__dict__[_SERVICE_ATTR] = _start(scheduler)
    if state is not False:
        service, server = state
        try:
            if service.pins is not None:
                service.pins.expire()
            server.serve_pending()
        except Exception:  # kvmesh must never stop the scheduler loop
            logger.exception("kvmesh: scheduler hook failed")
    return result


def after_flush_cache(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    state = scheduler.__dict__.get(_SERVICE_ATTR)
    if result and state:
        service, _ = state
        if service.pins is not None:
            service.pins.forget_all()
    return result


def _start(scheduler: Any) -> tuple[SchedulerService, ControlServer] | bool:
    """This scheduler's service and control socket, or False when it has none to serve."""
    base = os.environ.get(CONTROL_ENV)
    if not base:
        return False  # SGLang launched without kvmesh's launcher: nothing asks for pins
    try:
        first, _ = _owns_cache(scheduler)
        if not first:
            return False
        service = make_service(scheduler)
        server = ControlServer(control_endpoint(base, _dp_rank(scheduler)), service.handle)
    except Exception:
        logger.exception("kvmesh: could not start the scheduler's control socket; pins are off")
        return False
    logger.info("kvmesh: scheduler control socket at %s", server.endpoint)
    return service, server
