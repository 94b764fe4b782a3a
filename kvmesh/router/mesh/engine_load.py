"""Engine-reported load: what a worker's own Prometheus ``/metrics`` says it is running and queueing.

The router's load is an estimate (the requests it routed, tokens it counted); the engine knows the
truth, including requests that reached it some other way. At each health check the registry reads
the worker's ``/metrics`` and keeps the figures below, shown beside the router's estimate in
``/kvmesh/workers`` and as gauges, so a drift between the two is visible. What they count beyond
the router's own requests there (other replicas' in a mesh without replica sync, clients that call
the engine directly) enters the latency cost's view of the worker (``unseen_requests`` in
``/kvmesh/workers``). Known names (summed over label sets: one engine may report per model or per
DP rank):

=========  ==============================  ==========================
engine     running                         waiting
=========  ==============================  ==========================
vLLM       ``vllm:num_requests_running``   ``vllm:num_requests_waiting``
SGLang     ``sglang:num_running_reqs``     ``sglang:num_queue_reqs``
mock       vLLM's names
=========  ==============================  ==========================

The scan reads the exposition format line by line and compares whole metric names only; the rest
of a large ``/metrics`` page (histograms) costs one ``startswith`` per line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

_NAMES: dict[bytes, str] = {
    b"vllm:num_requests_running": "running",
    b"vllm:num_requests_waiting": "waiting",
    b"sglang:num_running_reqs": "running",
    b"sglang:num_queue_reqs": "waiting",
}
_PREFIXES = (b"vllm:num_requests_", b"sglang:num_")


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """Requests the engine itself reports: in its running batch and in its waiting queue."""

    running: float
    waiting: float
    at: float
    """``time.monotonic()`` of the read."""


def parse_engine_load(text: bytes, at: float) -> EngineLoad | None:
    """The known gauges of a Prometheus text page, or None when it has neither of them."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(_PREFIXES):
            continue
        brace = line.find(b"{")
        if brace >= 0:
            name, rest = line[:brace], line[line.rfind(b"}") + 1 :]
        else:
            name, _, rest = line.partition(b" ")
        kind = _NAMES.get(name)
        if kind is None:
            continue
        fields = rest.split()
        try:
            value = float(fields[0])
        except (IndexError, ValueError):
            continue
        if math.isfinite(value):
            found[kind] = found.get(kind, 0.0) + value
    if not found:
        return None
    return EngineLoad(found.get("running", 0.0), found.get("waiting", 0.0), at)
