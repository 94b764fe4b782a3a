"""The router configs under ``examples/`` load as a user loads them (``KVMESH_CONFIG``), and each
worker they describe carries what KV routing needs without asking the engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh.router.mesh.settings import MeshSettings

EXAMPLES = sorted((Path(__file__).resolve().parents[3] / "examples").glob("*/router.toml"))


def test_there_are_example_configs() -> None:
    assert {p.parent.name for p in EXAMPLES} >= {"vllm", "sglang", "trtllm"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.parent.name)
def test_an_example_config_loads_and_describes_its_workers(path: Path) -> None:
    settings = MeshSettings.load(environ={"KVMESH_CONFIG": str(path)})
    assert len(settings.workers) >= 2
    for spec in settings.workers:
        assert spec.block_size is not None and spec.kv_events_endpoints, spec
        assert spec.backend == path.parent.name, spec
