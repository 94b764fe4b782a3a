"""Where requests reach their engines: the client's requests matched to the engines' own request
logs (``kvmesh mock --request-log``).

An engine takes a burst's siblings into the step its first request starts only if they arrive
before that step begins, a fraction of a millisecond after the first on an idle engine. How far
behind the first the siblings arrive is the front's part in that: each request it parses,
tokenizes and routes before writing the next one widens the gap. The client's own numbers cannot
show it (its TTFT is the front's time and the engine's together); the engines' logs can.

The same records split each request's time to first token three ways (:func:`front_split`): from
the client's send to the engine taking the request in (the front's parsing, routing and forwarding,
then the engine's own reading and tokenizing), the engine's own time to its first token, and from
there to the client (the engine's send and the front's relay). Set beside another router's on the
same fleet, the first and last parts show where a front's time goes, and under load how much of it
is waiting for a busy front.

A request is matched to the engine's record of it by its prompt length and its arrival, the
earliest not yet matched at or after it was sent (a front names no request id the engine logs).
Siblings with identical prompts may be matched to each other's records, which changes nothing
here: a burst is measured by its requests' arrivals in the order they reached the engines.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvmesh.bench.report import percentile
from kvmesh.bench.runner import RequestResult, RunResult

MATCH_WINDOW_S = 1.0
"""How long after it was sent a request may reach its engine and still be matched to it."""
CLOCK_SLACK_S = 0.001
"""How far before its send time an arrival may read (the client's two clocks are read apart)."""


def matched(
    run: RunResult, engine_log: Sequence[dict[str, Any]]
) -> list[tuple[RequestResult, dict[str, Any] | None]]:
    """Each answered request of ``run`` (by send time) with the engine's record of it, or None where
    none was found: the earliest record of its prompt length not yet taken that arrived at or after
    it was sent, within :data:`MATCH_WINDOW_S`. Failed requests are left out."""
    by_length: dict[int, list[dict[str, Any]]] = {}
    for record in engine_log:
        if record.get("arrival") is not None and record.get("prompt_tokens") is not None:
            by_length.setdefault(record["prompt_tokens"], []).append(record)
    for records in by_length.values():
        records.sort(key=lambda record: record["arrival"])
    taken: set[int] = set()
    out: list[tuple[RequestResult, dict[str, Any] | None]] = []
    for r in sorted(run.results, key=lambda r: r.start):
        if not r.ok:
            continue
        found = None
        if r.prompt_tokens is not None:
            sent = run.monotonic_start + r.start
            for record in by_length.get(r.prompt_tokens, ()):
                arrival = record["arrival"]
                if arrival < sent - CLOCK_SLACK_S or id(record) in taken:
                    continue
                if arrival <= sent + MATCH_WINDOW_S:
                    found = record
                    taken.add(id(record))
                break
        out.append((r, found))
    return out


def burst_arrivals(run: RunResult, engine_log: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """For the bursts of ``run`` (several requests for one step of a session) whose requests were
    all found in ``engine_log`` (:func:`~kvmesh.bench.fleet.engine_requests`: each record with
    its ``engine`` index): how long after the burst's first arrival the others reached their
    engines (ms), and the share of them that ran in the first one's step on its engine. None
    where there are no such bursts (no bursts, or no logs)."""
    steps: dict[tuple[str, int], list[dict[str, Any] | None]] = {}
    for r in run.results:
        if not r.ok:  # a burst with a failed request is not measured
            steps.setdefault((r.session_id, r.step), []).append(None)
    for r, found in matched(run, engine_log):
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


def front_split(run: RunResult, engine_log: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """Each answered request's time to first token in three parts, in ms (p50, p90, mean over the
    requests found in ``engine_log`` with a first token on both sides):

    * ``to_engine_ms``: from the client's send to the engine taking the request in (its
      ``arrival``, stamped once the engine has read and tokenized it);
    * ``engine_ms``: from there to the engine's first token;
    * ``from_engine_ms``: from that token to the client receiving it.

    ``matched`` is the share of answered requests found. None where none was (no logs)."""
    pairs = matched(run, engine_log)
    to_engine: list[float] = []
    engine: list[float] = []
    from_engine: list[float] = []
    for r, record in pairs:
        if record is None or r.ttft is None or record.get("first_token") is None:
            continue
        sent = run.monotonic_start + r.start
        to_engine.append(1000.0 * (record["arrival"] - sent))
        engine.append(1000.0 * (record["first_token"] - record["arrival"]))
        from_engine.append(1000.0 * (sent + r.ttft - record["first_token"]))
    if not to_engine:
        return None

    def spread(xs: list[float]) -> dict[str, float | None]:
        return {"p50": percentile(xs, 50), "p90": percentile(xs, 90), "mean": sum(xs) / len(xs)}

    return {
        "to_engine_ms": spread(to_engine),
        "engine_ms": spread(engine),
        "from_engine_ms": spread(from_engine),
        "matched": len(to_engine) / len(pairs),
    }
