"""`benchmarks/burst_joins.py`: whether a burst's requests share one engine step, direct and through a front."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "burst_joins.py"


def _rows(out: str) -> list[list[str]]:
    rows = []
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and not set(cells[0]) <= {"-"} and cells[0] != "path":
            rows.append(cells)
    return rows


def test_every_burst_is_read_off_the_engines_own_log_for_each_path_and_prompt() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH), "--burst", "3", "--trials", "2", "--staggers", "0,1",
         "--fronts", "engine,kvmesh", "--context-words", "200", "--tail-words", "20"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = _rows(done.stdout)
    settings = [(r[0], r[1], r[2]) for r in rows]
    assert settings == [
        (path, stagger, kind)
        for path in ("engine", "kvmesh")
        for stagger in ("0", "1")
        for kind in ("cold", "warm")
    ]
    for _path, _stagger, _kind, joined, steps, spread, first, others in rows:
        together, trials = (int(x) for x in joined.split("/"))
        assert trials == 2 and 0 <= together <= 2
        # each burst of three was taken into one, two or three steps, and every burst is counted
        per_burst = dict(pair.split(":") for pair in steps.split())
        assert set(per_burst) <= {"1", "2", "3"} and sum(int(n) for n in per_burst.values()) == 2
        assert int(per_burst.get("1", 0)) == together
        assert float(spread) >= 0.0 and float(first) > 0.0 and float(others) > 0.0


def test_a_burst_of_one_and_an_unknown_path_are_refused() -> None:
    for flags, message in (
        (["--burst", "1"], "--burst must be at least 2"),
        (["--fronts", "nginx"], "unknown nginx"),
    ):
        done = subprocess.run(
            [sys.executable, str(BENCH), *flags], capture_output=True, text=True, timeout=60, check=False
        )
        assert done.returncode == 2
        assert message in done.stderr
