"""vLLM's own ``/metrics`` in an API server process of ``--api-server-count`` above 1, with kvmesh's
middleware in front (vLLM 0.33.0).

That ``/metrics`` reads Prometheus's multiprocess directory, where kvmesh's gauges read from the
live router at scrape time are not; the middleware adds them to vLLM's answer. Each case runs
:mod:`tests.engines.vllm_metrics_probe` in a fresh process with the directory set, as vLLM starts
its API server processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.engine_vllm, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
MESH = {"KVMESH_WORKERS": "http://127.0.0.1:9,http://127.0.0.1:10", "KVMESH_SELF_URL": "http://127.0.0.1:9"}


def probe(tmp_path: Path) -> dict[str, Any]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    environ.update(PYTHONPATH=str(REPO), PROMETHEUS_MULTIPROC_DIR=str(tmp_path), **MESH)
    done = subprocess.run(
        [sys.executable, "-m", "tests.engines.vllm_metrics_probe"],
        env=environ, cwd=REPO, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def test_kvmeshs_live_gauges_are_added_to_vllms_multiprocess_metrics(tmp_path: Path) -> None:
    out = probe(tmp_path)
    assert "vllm_probe_total 1.0" in out["bare"]
    assert "kvmesh_queue_pending_requests" not in out["bare"]  # in no file of the directory
    served = out["through_kvmesh"]
    assert "vllm_probe_total 1.0" in served
    assert 'kvmesh_relayed_chunks_total{path="direct"} 1.0' in served
    assert served.count("# TYPE kvmesh_queue_pending_requests gauge") == 1
    assert 'kvmesh_event_plane_connected{plane="zmq",replica=' in served
