"""kvmesh.bench.decisions: a front's decisions kept once each and joined to the requests they placed.

The decisions are shaped as ``GET /kvmesh/decisions`` gives them; the end-to-end run over a real
front is in ``test_routing_quality_requests.py``. These cases are the ones a short run may not
meet: a poll that finds the whole window new, a prompt counted from its bytes, a later turn decided
on a guess at its length, siblings of one burst, and the router's own request.
"""

from __future__ import annotations

from typing import Any

from kvmesh.bench.decisions import WINDOW, DecisionLog, joined
from kvmesh.bench.runner import RequestResult, RunResult

T0 = 1000.0  # the run's time.monotonic() at its start
BLOCK = 16


def _decision(
    rid: str, at_s: float, worker: str, overlap: int, prefill: float, **extra: Any
) -> dict[str, Any]:
    """As the router lists it, ``at_s`` after the run started (seen by a poll at ``T0 + at_s``)."""
    return {
        "request_id": rid,
        "age_s": 0.0,
        "reason": "kv",
        "worker_id": worker,
        "dp_rank": 0,
        "overlap_blocks": overlap,
        "queued_s": extra.pop("queued_s", 0.0),
        "candidates": [
            {"worker_id": worker, "chosen": True, "overlap_blocks": overlap, "prefill_tokens": prefill},
            {
                "worker_id": "other",
                "chosen": False,
                "overlap_blocks": extra.pop("other_overlap", 0),
                "prefill_tokens": prefill,
            },
        ],
        "_at_s": at_s,
    }


def _log(*decisions: dict[str, Any]) -> DecisionLog:
    log = DecisionLog("http://127.0.0.1:1")
    for d in decisions:
        log._take({"block_size": BLOCK, "decisions": [d]}, T0 + d.pop("_at_s"), first=False)
    return log


def _request(session: str, step: int, start: float, worker: str, prompt: int) -> RequestResult:
    return RequestResult(session, step, "u", start, ttft=0.05, prompt_tokens=prompt, worker_id=worker)


def _run(*requests: RequestResult) -> RunResult:
    return RunResult("kvmesh", list(requests), 10.0, 1, monotonic_start=T0)


def test_each_decision_meets_the_request_it_placed_by_worker_length_and_time() -> None:
    run = _run(
        _request("a", 1, 0.100, "w0", 5158),  # a cold prompt, decided on a count from its bytes
        _request("b", 1, 0.101, "w1", 5000),
        _request("a", 2, 2.000, "w0", 8887),  # decided on a guess at its length, at once
        _request("b", 2, 2.010, "w0", 300),  # (another worker than its turn 1: a move)
    )
    log = _log(
        _decision("r0", 0.103, "w0", 0, 4072.0),
        _decision("r1", 0.104, "w1", 0, 5000.0),
        _decision("r2", 2.002, "w0", 300, 6427.0 - 300 * BLOCK),
        _decision("r3", 2.013, "w0", 0, 300.0, other_overlap=10),
    )
    rows = {r["request_id"]: r for r in joined(log, run)}
    assert [(rows[i]["session"], rows[i]["turn"]) for i in ("r0", "r1", "r2", "r3")] == [
        ("a", 1),
        ("b", 1),
        ("a", 2),
        ("b", 2),
    ]
    assert [rows[i]["moved"] for i in ("r0", "r1", "r2", "r3")] == [False, False, False, True]
    assert rows["r2"]["start_s"] == 2.0 and rows["r2"]["at_s"] == 2.002


def test_a_burst_s_siblings_each_meet_their_own_decision() -> None:
    run = _run(*(_request("s", 1, 0.5 + i / 1000, "w0", 2000) for i in range(4)))
    log = _log(*(_decision(f"r{i}", 0.5015 + i / 1000, "w0", 120, 80.0) for i in range(4)))
    rows = joined(log, run)
    assert [r["start_s"] for r in rows] == [0.5, 0.501, 0.502, 0.503]


def test_a_queued_decision_meets_the_request_sent_before_its_wait() -> None:
    run = _run(_request("q", 1, 1.0, "w0", 900), _request("q2", 1, 1.79, "w0", 900))
    log = _log(_decision("late", 1.8, "w0", 0, 900.0, queued_s=0.8))
    (row,) = joined(log, run)
    assert (row["session"], row["start_s"]) == ("q", 1.0)  # (not the one sent 10 ms before it)


def test_the_router_s_own_request_and_a_stranger_stay_unjoined() -> None:
    run = _run(_request("c", 1, 3.0, "w0", 4000))
    log = _log(
        _decision("copy", 1.0, "w1", 0, 3000.0),  # a hot prefix's copy: no client request
        _decision("far", 3.4, "w0", 0, 4000.0),  # 400 ms after the only request on its worker
    )
    assert [(r["request_id"], r["session"], r["turn"]) for r in joined(log, run)] == [
        ("copy", None, None),
        ("far", None, None),
    ]


def test_each_decision_is_kept_once_and_a_window_found_all_new_counts_as_missed() -> None:
    log = DecisionLog("http://127.0.0.1:1")
    first = [{"request_id": f"a{i}", "age_s": 0.0} for i in range(WINDOW)]
    log._take({"block_size": BLOCK, "decisions": first}, T0, first=True)  # (a run's first poll)
    log._take({"block_size": BLOCK, "decisions": first[32:] + first[:32]}, T0 + 0.25, first=False)
    assert (len(log.decisions), log.missed) == (WINDOW, 0)
    window = [{"request_id": f"b{i}", "age_s": 0.1} for i in range(WINDOW)]
    log._take({"block_size": BLOCK, "decisions": window}, T0 + 0.5, first=False)
    assert (len(log.decisions), log.missed) == (2 * WINDOW, 1)
    assert log.decisions[-1]["at"] == T0 + 0.4
