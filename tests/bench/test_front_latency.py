"""`benchmarks/front_latency.py`: what each front adds to a cold prompt's first token, one engine, one run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "front_latency.py"


def _rows(out: str) -> dict[str, list[str]]:
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and not set(cells[0]) <= {"-"}:
            rows[cells[0]] = cells[1:]
    return rows


def test_each_kvmesh_front_is_timed_against_the_engine_alone_and_its_phases_shown() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH), "--requests", "2", "--rounds", "1", "--prompt-words", "300",
         "--no-sglang", "--no-progress"],
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = _rows(done.stdout)
    assert rows["engine alone"][1:] == ["-", "-"]
    for front in ("kvmesh round-robin", "kvmesh kv (default)"):
        ttft, added, p90 = (float(c) for c in rows[front])
        assert ttft > 0 and p90 >= added
    assert "sglang-router cache_aware" not in rows  # left out when asked
    # kv mode tokenized, routed, wrote and relayed every request it served (the warm-up turn's and
    # the round's): every phase has its mean
    phases = rows["mean per request"]
    assert all(float(us) > 0 for us in phases)
    # its total (arrival to decision) leaves out a cold prompt tokenized after it is sent: said so
    assert "tokenized and hashed after it is sent" in done.stdout


def test_a_round_count_below_one_is_refused() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH), "--rounds", "0"], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 2
    assert "--rounds must be at least 1" in done.stderr
