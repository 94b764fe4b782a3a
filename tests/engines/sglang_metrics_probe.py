"""What SGLang 0.5.23's ``/metrics`` serves once kvmesh's launcher has run (a child process of
tests/engines/test_sglang_metrics.py: whether ``prometheus_client`` writes a process's metrics to
the multiprocess directory is decided when it is first imported, once per process).

``python -m tests.engines.sglang_metrics_probe [sglang launch_server args...]`` prints one JSON
object. It runs kvmesh's launcher (``launcher.prepare``, which mounts kvmesh's router middleware
when ``KVMESH_WORKERS`` is set), then the step of SGLang's launch that sets up the multiprocess
directory (``set_prometheus_multiproc_dir``, called by ``_set_envs_and_config`` under
``--enable-metrics``), then makes one metric as SGLang's tokenizer manager makes its own and counts
one kvmesh relayed chunk. It reads SGLang's ``/metrics`` app (``add_prometheus_middleware``'s
mount, called through Starlette's TestClient), alone and on SGLang's own app behind kvmesh's
middleware; no model, scheduler or server runs.
"""

from __future__ import annotations

import json
import os
import sys

from tests.engines import sglang_env


def main() -> None:
    sglang_env.prepare()
    from kvmesh.adapters.sglang import launcher

    before = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    server_args = launcher.prepare(["--model-path", "dummy", *sys.argv[1:]], environ=os.environ)  # type: ignore[arg-type]
    after_prepare = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    imported_at_mount = "prometheus_client" in sys.modules
    from sglang.srt.utils.common import add_prometheus_middleware, set_prometheus_multiproc_dir

    if server_args.enable_metrics:
        set_prometheus_multiproc_dir()
    from prometheus_client import Counter
    from starlette.applications import Starlette
    from starlette.testclient import TestClient

    Counter("sglang_probe", "made after the launch's set-up, as SGLang's tokenizer manager's are").inc()
    from kvmesh.router.mesh.metrics import get_metrics

    get_metrics().relayed_chunks["direct"].inc()
    served = through_kvmesh = ""
    if server_args.enable_metrics:
        app = Starlette()
        add_prometheus_middleware(app)
        served = TestClient(app).get("/metrics").text
        from sglang.srt.entrypoints import http_server

        add_prometheus_middleware(http_server.app)  # as the launch does, on the app kvmesh is mounted on
        through_kvmesh = TestClient(http_server.app).get("/metrics").text
    print(
        json.dumps(
            {
                "before": before,
                "after_prepare": after_prepare,
                "after_launch": os.environ.get("PROMETHEUS_MULTIPROC_DIR"),
                "imported_at_mount": imported_at_mount,
                "metrics": served,
                "through_kvmesh": through_kvmesh,
            }
        )
    )


if __name__ == "__main__":
    main()
