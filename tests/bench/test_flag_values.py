"""The benchmark scripts refuse a flag value they cannot run, before running anything: a usage
error naming the flag, exit 2, no traceback (and no hang, no empty table, no other run)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.parametrize(
    ("script", "flags", "message"),
    [
        # (each engine is a process of its own, as in kvmesh demo, which takes at most 64)
        ("routing_quality.py", ["--engines", "100000"], "argument --engines: must be at most 64"),
        ("speculative_prefill.py", ["--engines", "100000"], "argument --engines: must be at most 64"),
        (  # (each engine refused it once the run had begun, and the script ended in a traceback)
            "routing_quality.py",
            ["--num-blocks", "2048,99999999"],
            "argument --num-blocks: '2048,99999999': each size must be at most 4194304",
        ),
        ("fleet_scale.py", ["--planes", "bogus"], "--planes must be zmq, nats or both"),
        ("fleet_scale.py", ["--planes", "zmq,bogus"], "--planes must be zmq, nats or both"),
        (
            "fleet_scale.py",
            ["--sizes", "0"],
            "argument --sizes: must be comma-separated integers of at least 1",
        ),
        (
            "fleet_scale.py",
            ["--sizes", "x"],
            "argument --sizes: must be comma-separated integers of at least 1",
        ),
        ("fleet_scale.py", ["--json", "/nonexistent-kvmesh-dir/f.json"], "argument --json: directory"),
        ("hashing.py", ["--repeat", "0"], "argument --repeat: must be at least 1, got 0"),
        ("hashing.py", ["--repeat", "5"], "--repeat must be at least 10"),
        ("hashing.py", ["--tokens", "0"], "argument --tokens: must be at least 1, got 0"),
        ("hashing.py", ["--tokens", "8"], "--tokens must be at least --block-size (16), got 8"),
        ("hashing.py", ["--block-size", "0"], "argument --block-size: must be at least 1, got 0"),
        ("wire.py", ["--repeat", "0"], "argument --repeat: must be at least 1, got 0"),
        ("wire.py", ["--repeat", "9"], "--repeat must be at least 10"),
        ("wire.py", ["--e2e-batches", "0"], "argument --e2e-batches: must be at least 1, got 0"),
        (
            "wire.py",
            ["--paced-gap-ms", "-1"],
            "argument --paced-gap-ms: must be a finite number of at least 0",
        ),
        ("overhead.py", ["--requests", "0", "--rounds", "1"], "--requests must be at least 32"),
        ("overhead.py", ["--rounds", "0"], "argument --rounds: must be at least 1, got 0"),
        ("relay.py", ["--events", "0"], "argument --events: must be at least 1, got 0"),
        ("relay.py", ["--gap-ms", "-1"], "argument --gap-ms: must be a finite number of at least 0"),
        ("relay.py", ["--rounds", "0"], "argument --rounds: must be at least 1, got 0"),
        (
            "mock_engine.py",
            ["--concurrency", "x"],
            "argument --concurrency: must be comma-separated integers",
        ),
        (
            "mock_engine.py",
            ["--concurrency", "0", "--skip-http"],
            "argument --concurrency: must be comma-separated integers",
        ),
        ("mock_engine.py", ["--speedup", "0"], "--speedup must be a positive finite number, got 0.0"),
        ("route_decision.py", ["--model", "bogus"], "argument --model: invalid choice: 'bogus'"),
        ("route_decision.py", ["--block-size", "0"], "--block-size must be at least 1, got 0"),
        ("route_decision.py", ["--sequences", "50"], "--sequences must be at least 100, got 50"),
        ("disaggregated.py", ["--sessions", "0"], "argument --sessions: must be at least 1, got 0"),
        ("disaggregated.py", ["--plot", "/nonexistent-kvmesh-dir/p.png"], "argument --plot: directory"),
        ("speculative_prefill.py", ["--engines", "0"], "argument --engines: must be at least 1, got 0"),
        ("speculative_prefill.py", ["--turns", "1"], "--turns must be at least 2"),
    ],
)
def test_a_value_the_script_cannot_run_is_refused_up_front(
    script: str, flags: list[str], message: str
) -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH / script), *flags], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 2, (done.stdout[-1000:], done.stderr[-2000:])
    assert message in done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
