"""Engine-reported load: what a worker's own Prometheus ``/metrics`` says it is running and queueing.

The router's load is an estimate (the requests it routed, tokens it counted); the engine knows the
truth, including requests that reached it some other way. At each health check the registry reads
the worker's ``/metrics`` and keeps the figures below, shown beside the router's estimate in
``/kvmesh/workers`` and as gauges, so a drift between the two is visible. What they count beyond
the router's own requests there (other replicas' in a mesh without replica sync, clients that call
the engine directly) enters the latency cost's view of the worker (``unseen_requests`` in
``/kvmesh/workers``). Known names (summed over label sets: one engine may report per model, per
priority or per DP rank):

=========  ==============================  ==========================
engine     running                         waiting
=========  ==============================  ==========================
vLLM       ``vllm:num_requests_running``   ``vllm:num_requests_waiting``
SGLang     ``sglang:num_running_reqs``     ``sglang:num_queue_reqs``
mock       vLLM's names
=========  ==============================  ==========================

An engine with data-parallel ranks labels each rank's series, and its ranks are routed to apart:
vLLM's ``engine`` label is the DP rank of the engine core (``vllm/v1/metrics/loggers.py``: the
label values are the engine indexes the API server manages), SGLang's ``dp_rank`` label the
scheduler's DP rank (``sglang/srt/observability/metrics_collector.py``, present when DP is on). So
each rank's counts are kept apart as well (:attr:`EngineLoad.ranks`). SGLang labels its series by
TP rank too, and with ``--enable-metrics-for-all-schedulers`` every TP rank of one scheduler
reports that scheduler's same queue: a rank's count is the largest over its TP ranks, not their
sum (summed, a TP-4 engine's queue read four times its length).

The scan reads the exposition format line by line and compares whole metric names only; the rest
of a large ``/metrics`` page (histograms) costs one ``startswith`` per line.
"""

from __future__ import annotations

from dataclasses import dataclass

_NAMES: dict[bytes, str] = {
    b"vllm:num_requests_running": "running",
    b"vllm:num_requests_waiting": "waiting",
    b"sglang:num_running_reqs": "running",
    b"sglang:num_queue_reqs": "waiting",
}
_PREFIXES = (b"vllm:num_requests_", b"sglang:num_")


_RANK_LABELS = (b"engine", b"dp_rank")
"""The label naming a series' DP rank: vLLM's, SGLang's."""
_TP_LABEL = b"tp_rank"
_MAX_COUNT = 1e9
"""Requests no engine holds: a page claiming more is broken, and its sums would overflow."""


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """Requests the engine itself reports: in its running batch and in its waiting queue."""

    running: float
    waiting: float
    at: float
    """``time.monotonic()`` of the read."""
    ranks: dict[int, tuple[float, float]] | None = None
    """``(running, waiting)`` per DP rank, when every series names its rank; None otherwise (the
    totals are then all there is)."""


def parse_engine_load(text: bytes, at: float) -> EngineLoad | None:
    """The known gauges of a Prometheus text page, or None when it has neither of them."""
    # per (kind, DP rank or None, TP rank or None): the sum over the remaining labels
    series: dict[tuple[str, int | None, bytes | None], float] = {}
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
        if not 0.0 <= value < _MAX_COUNT:  # NaN, infinities, negatives: not a count of requests
            continue
        rank: int | None = None
        tp: bytes | None = None
        if brace >= 0:
            labels = series_labels(line[brace + 1 : line.rfind(b"}")])
            tp = labels.get(_TP_LABEL)
            for label in _RANK_LABELS:
                if label in labels:
                    rank = _rank(labels[label])
                    break
        one = (kind, rank, tp)
        series[one] = series.get(one, 0.0) + value
    if not series:
        return None
    # a scheduler's queue, as many times as it has TP ranks reporting it, counts once
    per_rank: dict[tuple[str, int | None], float] = {}
    for (kind, rank, _), value in series.items():
        per_rank[kind, rank] = max(per_rank.get((kind, rank), 0.0), value)
    running = sum(v for (kind, _), v in per_rank.items() if kind == "running")
    waiting = sum(v for (kind, _), v in per_rank.items() if kind == "waiting")
    ranks: dict[int, tuple[float, float]] | None = None
    if all(rank is not None for _, rank in per_rank):
        ranks = {}
        for (kind, rank), value in per_rank.items():
            assert rank is not None
            run, wait = ranks.get(rank, (0.0, 0.0))
            ranks[rank] = (run + value, wait) if kind == "running" else (run, wait + value)
    return EngineLoad(running, waiting, at, ranks)


def _rank(value: bytes) -> int | None:
    """A DP rank label's value as a rank; None when it is not a small non-negative integer."""
    if not value.isdigit() or len(value) > 6:
        return None
    return int(value)


def series_labels(section: bytes) -> dict[bytes, bytes]:
    """The label pairs between a series' braces (values unescaped only as far as comparing them
    needs: a rank is digits)."""
    out: dict[bytes, bytes] = {}
    i, n = 0, len(section)
    while i < n:
        eq = section.find(b"=", i)
        if eq < 0 or eq + 1 >= n or section[eq + 1 : eq + 2] != b'"':
            break
        name = section[i:eq].strip(b" ,")
        j = eq + 2
        value = bytearray()
        while j < n:
            c = section[j]
            if c == 0x5C and j + 1 < n:  # a backslash escapes the next byte
                value.append(section[j + 1])
                j += 2
                continue
            if c == 0x22:  # the closing quote
                break
            value.append(c)
            j += 1
        out[name] = bytes(value)
        i = j + 1
    return out
