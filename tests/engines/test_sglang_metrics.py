"""SGLang's own ``/metrics`` with kvmesh mounted (SGLang 0.5.23, ``--enable-metrics``).

SGLang serves only what its processes write to Prometheus's multiprocess directory, which it sets
up at launch; ``prometheus_client`` decides at its first import whether a process writes there.
kvmesh's middleware imports it when the launcher mounts it, before that launch step, so the
launcher sets the directory up first. Each case runs :mod:`tests.engines.sglang_metrics_probe` in
a fresh process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.engines import sglang_env

pytestmark = [pytest.mark.engine_sglang, pytest.mark.timeout(300)]

MESH = {"KVMESH_WORKERS": "http://127.0.0.1:9,http://127.0.0.1:10", "KVMESH_SELF_URL": "http://127.0.0.1:9"}


def probe(tmp_path: Path, *args: str, **env: str) -> dict[str, Any]:
    environ = {
        k: v for k, v in os.environ.items() if not k.startswith("KVMESH_") and k != "PROMETHEUS_MULTIPROC_DIR"
    }
    environ.update(PYTHONPATH=str(sglang_env.REPO), KVMESH_SGLANG_CONTROL=f"ipc://{tmp_path}/control", **env)
    done = subprocess.run(
        [sys.executable, "-m", "tests.engines.sglang_metrics_probe", *args],
        env=environ, cwd=sglang_env.REPO, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def test_with_a_mesh_sglangs_own_metrics_and_kvmeshs_reach_its_metrics_endpoint(tmp_path: Path) -> None:
    out = probe(tmp_path, "--enable-metrics", **MESH)
    assert out["imported_at_mount"]  # the middleware imports prometheus_client before the launch
    assert "sglang_probe_total 1.0" in out["metrics"]
    assert 'kvmesh_relayed_chunks_total{path="direct"} 1.0' in out["metrics"]
    assert out["after_prepare"] and out["after_launch"] == out["after_prepare"]


def test_with_a_mesh_kvmeshs_live_gauges_are_added_to_sglangs_metrics(tmp_path: Path) -> None:
    # read from the router when scraped, they are in no file of the multiprocess directory
    out = probe(tmp_path, "--enable-metrics", **MESH)
    assert "kvmesh_queue_pending_requests" not in out["metrics"]
    served = out["through_kvmesh"]
    assert "sglang_probe_total 1.0" in served
    assert 'kvmesh_relayed_chunks_total{path="direct"} 1.0' in served
    assert served.count("# TYPE kvmesh_queue_pending_requests gauge") == 1
    assert 'kvmesh_event_plane_connected{plane="zmq",replica=' in served


def test_a_directory_the_user_set_is_kept(tmp_path: Path) -> None:
    mine = tmp_path / "prometheus"
    mine.mkdir()
    out = probe(tmp_path, "--enable-metrics", PROMETHEUS_MULTIPROC_DIR=str(mine), **MESH)
    assert out["after_prepare"] == out["after_launch"] == str(mine)
    assert "sglang_probe_total 1.0" in out["metrics"]
    assert any(mine.iterdir())  # the metrics were written where the user asked


def test_without_enable_metrics_nothing_is_set_up(tmp_path: Path) -> None:
    out = probe(tmp_path, **MESH)
    assert out["before"] is None and out["after_prepare"] is None and out["after_launch"] is None
