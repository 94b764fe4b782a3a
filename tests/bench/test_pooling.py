"""`benchmarks/pooling.py`: embedding requests of mixed sizes through each front, on fresh mock
fleets."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.bench.test_prompt_batches import _rows

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "pooling.py"


def test_every_input_is_embedded_and_counted_by_the_engines() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH), "--fronts", "kvmesh,round-robin", "--engines", "2", "--requests", "12",
         "--doc-share", "0.5", "--doc-inputs", "3", "--doc-words", "40", "--query-words", "5",
         "--rate", "50", "--rounds", "1", "--seed", "4"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    table, ratios = done.stdout.split("kvmesh against each front")
    rows = _rows(table, "front")
    assert set(rows) == {"kvmesh", "round-robin"}
    inputs = {sum(int(n) for n in per_engine.split()) for *_, per_engine, _errors in rows.values()}
    assert len(inputs) == 1 and inputs.pop() > 12  # (the same work for both; a batch counts its inputs)
    for _front, query_p50, query_p99, doc_p50, doc_p99, rate, _per_engine, errors in rows.values():
        assert errors == "0"
        assert 0 < float(query_p50) <= float(query_p99) and 0 < float(doc_p50) <= float(doc_p99)
        assert float(rate) > 0
    assert set(_rows(ratios, "ratio")) == {"kvmesh / round-robin"}


def test_a_share_outside_0_to_1_is_refused() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH), "--doc-share", "1.5"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2 and "--doc-share: must be between 0 and 1, got 1.5" in done.stderr
