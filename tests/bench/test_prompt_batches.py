"""`benchmarks/prompt_batches.py`: batches of prompts through each front, on fresh mock fleets."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "prompt_batches.py"


def _rows(out: str, first: str) -> dict[str, list[str]]:
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and not set(cells[0]) <= {"-"} and cells[0] != first:
            rows[cells[0]] = cells
    return rows


def test_every_prompt_of_every_batch_is_answered_and_counted_by_the_engines() -> None:
    for api in ("completions", "generate"):
        done = subprocess.run(
            [sys.executable, str(BENCH), "--fronts", "kvmesh,round-robin", "--engines", "2", "--batches", "3",
             "--batch-size", "4", "--tasks", "2", "--context-words", "80", "--question-words", "4",
             "--rounds", "1", "--api", api],
            capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        table, ratios = done.stdout.split("kvmesh against each front")
        rows = _rows(table, "front")
        assert set(rows) == {"kvmesh", "round-robin"}
        for _front, p50, p90, rate, hits, per_engine, errors in rows.values():
            assert errors == "0"
            assert sum(int(n) for n in per_engine.split()) == 12  # (3 batches of 4, one request a prompt)
            assert 0 < float(p50) <= float(p90) and float(rate) > 0 and 0.0 <= float(hits) <= 1.0
        assert float(rows["kvmesh"][4]) > 0.0  # (a task's prompts share its context's blocks)
        assert set(_rows(ratios, "ratio")) == {"kvmesh / round-robin"}


def test_an_unknown_front_is_refused() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH), "--fronts", "nginx"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2 and "unknown or unavailable fronts: nginx" in done.stderr
