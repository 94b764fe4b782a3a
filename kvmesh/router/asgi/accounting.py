"""What a response tells the router while it streams: load accounting and, for routed requests,
metrics, the cached-tokens reconciliation and the ``nvext`` echo.

Both classes are the :class:`~kvmesh.router.asgi.tap.Observer` of one response. :class:`LoadAccount`
is all a hop (a request another replica routed here) needs: prefill done at the first event, output
growth, and the request's blocks freed at the end. :class:`RoutedAccount` adds what the replica that
made the decision reports: TTFT / ITL / OSL, the engine's ``cached_tokens`` against the prediction,
the echo the client asked for, and the session ``close`` that follows the turn.
"""

from __future__ import annotations

import time
from typing import Any

from kvmesh._types import WorkerKey
from kvmesh.router.core.kv_router import Decision
from kvmesh.router.mesh.runtime import Mesh
from kvmesh.router.request.nvext import Nvext


class LoadAccount:
    """The router's load view of one request while it runs on a worker."""

    __slots__ = ("mesh", "request_id")

    def __init__(self, mesh: Mesh, request_id: str) -> None:
        self.mesh = mesh
        self.request_id = request_id

    def first_event(self, streamed: bool = True) -> None:
        self.mesh.router.first_token(self.request_id, time.monotonic(), timed=streamed)

    def events(self, n: int) -> None:
        self.mesh.router.output_tokens(self.request_id, n, time.monotonic())

    def usage(self, usage: dict[str, Any]) -> None:
        return None

    def echo(self) -> dict[str, Any] | None:
        return None

    def end(self, complete: bool) -> None:
        now = time.monotonic()
        if complete:
            sample = self.mesh.router.finished(self.request_id, now)
            if sample is not None:  # one of this replica's decisions: the latency model's check
                self.mesh.record_ttft_prediction(sample)
        else:
            self.mesh.router.cancel(self.request_id, now)
        self.mesh.pump(now)


class RoutedAccount(LoadAccount):
    """A request this replica routed: its load, its metrics, its echo and its session close."""

    __slots__ = (
        "decision",
        "last_event",
        "nvext",
        "out_events",
        "prefill_worker",
        "routed_at",
        "t0",
        "t_first",
        "wall0",
        "worker_id",
    )

    def __init__(self, mesh: Mesh, request_id: str, nvext: Nvext, t0: float, wall0: float) -> None:
        super().__init__(mesh, request_id)
        self.nvext = nvext
        self.t0 = t0
        self.wall0 = wall0
        self.routed_at = 0.0
        self.decision: Decision | None = None
        self.worker_id = ""
        self.prefill_worker: WorkerKey | None = None
        """(worker, dp rank) that ran the prefill stage of a disaggregated request."""
        self.t_first = 0.0
        self.last_event = 0.0
        self.out_events = 0

    def dispatched(self, decision: Decision, isl: int) -> None:
        """The request goes to ``decision.worker`` now (again, after a failover)."""
        self.decision = decision
        self.worker_id = decision.worker[0]
        if isl:
            self.mesh.metrics.kv_hit_rate.observe(min(1.0, decision.cached_tokens / isl))

    def first_event(self, streamed: bool = True) -> None:
        now = time.perf_counter()
        self.t_first = self.last_event = now
        super().first_event(streamed)
        self.mesh.metrics.ttft.observe(now - self.t0)

    def events(self, n: int) -> None:
        now = time.perf_counter()
        if self.out_events:
            self.mesh.metrics.itl.observe(now - self.last_event)
        self.last_event = now
        self.out_events += n
        super().events(n)

    def usage(self, usage: dict[str, Any]) -> None:
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if isinstance(cached, int) and not isinstance(cached, bool) and self.decision is not None:
            self.mesh.record_cached(self.worker_id, self.decision.cached_tokens, cached)
            self.mesh.router.reported_cached(self.request_id, cached)

    def echo(self) -> dict[str, Any] | None:
        nv = self.nvext
        if not nv.wants_echo:
            return None
        out: dict[str, Any] = {}
        if nv.want_worker_id:
            prefill = self.prefill_worker
            if prefill is None:
                out["worker_id"] = self.worker_id
            else:  # both stages, as the reference names them
                decode_rank = self.decision.worker[1] if self.decision is not None else None
                out["worker_id"] = {
                    "prefill_worker_id": prefill[0],
                    "decode_worker_id": self.worker_id,
                    "prefill_dp_rank": prefill[1],
                    "decode_dp_rank": decode_rank,
                }
        if nv.want_timing:
            now = time.perf_counter()
            decision = self.decision
            out["timing"] = {
                "request_received_ms": round(self.wall0 * 1000, 3),
                "routing_ms": round((self.routed_at - self.t0) * 1000, 3),
                "ttft_ms": round((self.t_first - self.t0) * 1000, 3) if self.t_first else None,
                "total_ms": round((now - self.t0) * 1000, 3),
                "queue_ms": round(decision.waited * 1000, 3) if decision else 0.0,
                "cached_tokens_predicted": decision.cached_tokens if decision else 0,
            }
        return out

    def end(self, complete: bool) -> None:
        mesh = self.mesh
        if complete:
            mesh.metrics.osl.observe(self.out_events)
        session = self.nvext.session
        if session is not None and session.action == "close" and self.worker_id:
            mesh.spawn(mesh.close_session(self.worker_id, session.session_id))
        super().end(complete)
