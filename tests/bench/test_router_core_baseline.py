"""`benchmarks/router_core.py --baseline REV`: route() of another revision's code, timed in the same run."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"
SMALL = ["--sequences", "400", "--query-blocks", "128"]  # seconds, not minutes


def _git(*args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, check=False)


pytestmark = pytest.mark.skipif(_git("rev-parse", "HEAD").returncode != 0, reason="not a git checkout")


def test_an_unknown_revision_is_refused_before_anything_runs() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH / "router_core.py"), "--baseline", "no-such-revision", *SMALL],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--baseline: 'no-such-revision' is not a commit" in done.stderr
    assert done.stdout == ""


def test_the_baseline_table_times_each_tree_in_every_round() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH / "router_core.py"), "--baseline", "HEAD", "--rounds", "2", *SMALL],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    head = _git("rev-parse", "HEAD").stdout.decode().strip()
    table = done.stdout[done.stdout.index("| route(), 128 blocks") :].splitlines()
    rows = [line for line in table if line.startswith("| ")][1:]  # the header row aside
    names = [r.split("|")[1].strip() for r in rows]
    assert names == [
        f"HEAD ({head[:9]}), its default",
        "this tree, --router-cost-model dynamo",
        "this tree, --router-cost-model latency",
    ]
    assert rows[0].split("|")[3].strip() == "1.00x (1.00-1.00)"  # the baseline against itself
    # every contender ran once per round, each in a process of its own
    progress = [line for line in done.stderr.splitlines() if line.startswith("route() vs HEAD")]
    assert len(progress) == 6 and {p.split(", ", 1)[1] for p in progress} == set(names)


def test_route_decision_times_the_kvmesh_it_is_given(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("router_core", BENCH / "router_core.py")
    assert spec is not None and spec.loader is not None
    router_core = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(router_core)
    router_core.revision_tree(router_core.resolve_commit("HEAD"), str(tmp_path))
    done = subprocess.run(
        [sys.executable, str(BENCH / "route_decision.py"), "--model", "dynamo", "--samples", "5", *SMALL],
        capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    assert out["kvmesh"] == str(tmp_path / "kvmesh" / "__init__.py")
    assert out["model"] == "dynamo" and len(out["samples_s"]) == 5 and all(s > 0 for s in out["samples_s"])
