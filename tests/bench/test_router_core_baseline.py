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


def test_the_baseline_table_times_each_tree_call_by_call() -> None:
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
    # the revision's tree and this one were each built once, then timed together
    progress = [line for line in done.stderr.splitlines() if line.startswith("route() vs HEAD")]
    built = [p for p in progress if ": building " in p]
    assert len(built) == 3 and "kvmesh-baseline-" in built[0] and built[1].endswith(f"{REPO} (dynamo)")
    assert progress[-1] == "route() vs HEAD: 2 rounds, interleaved"


def _head_tree(into: Path) -> None:
    """HEAD's kvmesh package extracted into ``into``, by the script's own helpers."""
    spec = importlib.util.spec_from_file_location("router_core", BENCH / "router_core.py")
    assert spec is not None and spec.loader is not None
    router_core = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(router_core)
    router_core.revision_tree(router_core.resolve_commit("HEAD"), str(into))


_CONTENDERS = """
import argparse, importlib.util, json, sys
spec = importlib.util.spec_from_file_location("router_core", sys.argv[1])
rc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rc)
import kvmesh
before = kvmesh.__file__
args = argparse.Namespace(sequences=400, blocks=64, block_size=16, query_blocks=128)
theirs = rc._load_contender(sys.argv[2], "default", args)
theirs_file = sys.modules[type(theirs[0]).__module__].__file__  # (the modules it was built on)
ours = rc._load_contender(sys.argv[3], "latency", args)
ours_file = sys.modules[type(ours[0]).__module__].__file__
samples = rc.interleaved_routes([theirs, ours], 2, 3)
from kvmesh import _native
print(json.dumps({
    "theirs": theirs_file,
    "theirs_modules": theirs[2]["kvmesh"].__file__,
    "ours": ours_file,
    "ours_build": _native.status()["build"],
    "shape": [[len(r) for r in c] for c in samples],
    "before": before,
}))
"""


def test_each_contender_runs_on_its_own_revision(tmp_path: Path) -> None:
    _head_tree(tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", _CONTENDERS, str(BENCH / "router_core.py"), str(tmp_path), str(REPO)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    # the revision's router runs on the revision's modules, this tree's on this tree's
    assert out["theirs"].startswith(str(tmp_path)) and out["theirs_modules"].startswith(str(tmp_path))
    # (this tree's compiled build, where one exists for its sources: what its router runs)
    ours_root = str(REPO / "kvmesh") if out["ours_build"] is None else out["ours_build"]
    assert out["ours"].startswith(ours_root) and not out["ours"].startswith(str(tmp_path))
    assert out["shape"] == [[3, 3], [3, 3]]  # every contender, every round, every call


def test_route_decision_times_the_kvmesh_it_is_given(tmp_path: Path) -> None:
    _head_tree(tmp_path)
    done = subprocess.run(
        [sys.executable, str(BENCH / "route_decision.py"), "--model", "dynamo", "--samples", "5", *SMALL],
        capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    assert out["kvmesh"] == str(tmp_path / "kvmesh" / "__init__.py")
    assert out["model"] == "dynamo" and len(out["samples_s"]) == 5 and all(s > 0 for s in out["samples_s"])
