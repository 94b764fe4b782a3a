"""The gauges read from live routers at scrape time (kvmesh.router.mesh.metrics): one series per
replica name, so an OpenMetrics exposition stays one a scraper accepts.

Found in a fresh-clone CI run: a router's replica name ended in the low 16 bits of its object's
address, and a router alive since an earlier test had the same bits as the one being scraped. Two
series with one label set made ``test_scrape``'s OpenMetrics answer invalid."""

from __future__ import annotations

from typing import Any

from prometheus_client.openmetrics.parser import text_string_to_metric_families

from kvmesh.router.core.config import RouterConfig
from kvmesh.router.mesh.metrics import GaugeSource, get_metrics
from kvmesh.router.mesh.runtime import Mesh
from kvmesh.router.mesh.settings import MeshSettings, WorkerSpec

LIVE = "kvmesh_queue_pending_requests"


class _Owner:
    """What owns a router's gauges (a Mesh, in the package): alive while it is referenced."""


def _settings(**extra: Any) -> MeshSettings:
    return MeshSettings(
        workers=(WorkerSpec("http://127.0.0.1:9", "w"),), router=RouterConfig(use_kv_events=False), **extra
    )


def _pending(text: str) -> dict[str, list[float]]:
    """replica -> the values of its pending-requests series, from an OpenMetrics text."""
    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name == LIVE:
            for sample in family.samples:
                out.setdefault(sample.labels["replica"], []).append(sample.value)
    return out


def test_routers_of_one_process_have_names_of_their_own() -> None:
    meshes = [Mesh(_settings()) for _ in range(300)]  # (alive together: ids cannot repeat)
    assert len({m.replica for m in meshes}) == len(meshes)


def test_one_replica_name_is_one_series_the_running_routers() -> None:
    """Two routers given one self id, the first stopped and not yet collected: the scrape has
    one series under that name, the running one's, and parses as OpenMetrics."""
    metrics = get_metrics()
    stopped, running = _Owner(), _Owner()
    metrics.track(
        stopped, GaugeSource("same-id", lambda: (), lambda: (7, 70), lambda: (), running=lambda: False)
    )
    metrics.track(
        running, GaugeSource("same-id", lambda: (), lambda: (2, 20), lambda: (), running=lambda: True)
    )
    text = metrics.render_live(openmetrics=True).decode()
    assert _pending(text)["same-id"] == [2.0]
    del stopped, running
