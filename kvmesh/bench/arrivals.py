"""Where a burst's requests reach their engines: the client's requests matched to the engines' own
request logs (``kvmesh mock --request-log``).

An engine takes a burst's siblings into the step its first request starts only if they arrive
before that step begins, a fraction of a millisecond after the first on an idle engine. How far
behind the first the siblings arrive is the front's part in that: each request it parses,
tokenizes and routes before writing the next one widens the gap. The client's own numbers cannot
show it (its TTFT is the front's time and the engine's together); the engines' logs can.

A request is matched to the engine's record of it by its prompt length and its arrival, the
earliest not yet matched at or after it was sent (a front names no request id the engine logs).
Siblings with identical prompts may be matched to each other's records, which changes nothing
here: a burst is measured by its requests' arrivals in the order they reached the engines.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvmesh.bench.report import percentile
from kvmesh.bench.runner import RunResult

MATCH_WINDOW_S = 1.0
"""How long after it was sent a request may reach its engine and still be matched to it."""
CLOCK_SLACK_S = 0.001
"""How far before its send time an arrival may read (the client's two clocks are read apart)."""


def burst_arrivals(run: RunResult, engine_log: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """For the bursts of ``run`` (several requests for one step of a session) whose requests were
    all found in ``engine_log`` (:func:`~kvmesh.bench.fleet.engine_requests`: each record with
    its ``engine`` index): how long after the burst's first arrival the others reached their
    engines (ms), and the share of them that ran in the first one's step on its engine. None
    where there are no such bursts (no bursts, or no logs)."""
    by_length: dict[int, list[dict[str, Any]]] = {}
    for record in engine_log:
        if record.get("arrival") is not None and record.get("prompt_tokens") is not None:
            by_length.setdefault(record["prompt_tokens"], []).append(record)
    for records in by_length.values():
        records.sort(key=lambda record: record["arrival"])
    taken: set[int] = set()
    steps: dict[tuple[str, int], list[dict[str, Any] | None]] = {}
    for r in sorted(run.results, key=lambda r: r.start):
        found = None
        if r.ok and r.prompt_tokens is not None:
            sent = run.monotonic_start + r.start
            for record in by_length.get(r.prompt_tokens, ()):
                arrival = record["arrival"]
                if arrival < sent - CLOCK_SLACK_S or id(record) in taken:
                    continue
                if arrival <= sent + MATCH_WINDOW_S:
                    found = record
                    taken.add(id(record))
                break
        steps.setdefault((r.session_id, r.step), []).append(found)
    gaps_ms: list[float] = []
    joined = siblings = bursts = 0
    for group in steps.values():
        if len(group) < 2 or any(record is None for record in group):
            continue
        arrived = sorted((record for record in group if record is not None), key=lambda x: x["arrival"])
        first = arrived[0]
        bursts += 1
        for record in arrived[1:]:
            siblings += 1
            gaps_ms.append(1000.0 * (record["arrival"] - first["arrival"]))
            if (
                record["engine"] == first["engine"]
                and record.get("step") is not None
                and record.get("step") == first.get("step")
            ):
                joined += 1
    if not bursts:
        return None
    return {
        "bursts": bursts,
        "siblings_after_first_ms": {"p50": percentile(gaps_ms, 50), "mean": sum(gaps_ms) / len(gaps_ms)},
        "joined_share": joined / siblings,
    }
