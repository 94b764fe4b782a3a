"""What vLLM 0.33.0's ``/metrics`` serves in one of several API server processes, with kvmesh's
middleware in front (a child process of tests/engines/test_vllm_metrics.py).

With ``--api-server-count`` above 1, vLLM's parent process sets ``PROMETHEUS_MULTIPROC_DIR``
(``setup_multiprocess_prometheus``) before it starts the API server processes, so each starts with
it set, as this process does. It mounts ``/metrics`` with vLLM's own ``attach_router`` (whose
registry then reads the multiprocess directory), makes one metric as vLLM's stat loggers make
theirs, counts one kvmesh relayed chunk and reads ``/metrics`` through Starlette's TestClient, on
the bare app and on the app with kvmesh's vLLM middleware added. Prints one JSON object.
"""

from __future__ import annotations

import json
import warnings


def main() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from fastapi import FastAPI
        from prometheus_client import Counter
        from starlette.testclient import TestClient
        from vllm.entrypoints.serve.instrumentator.metrics import attach_router

    from kvmesh.adapters.vllm import KvMeshMiddleware
    from kvmesh.router.mesh.metrics import get_metrics

    bare = FastAPI()
    attach_router(bare)
    fronted = FastAPI()
    attach_router(fronted)
    fronted.add_middleware(KvMeshMiddleware)
    Counter("vllm_probe", "made as vLLM's stat loggers make theirs").inc()
    get_metrics().relayed_chunks["direct"].inc()
    print(
        json.dumps(
            {
                "bare": TestClient(bare).get("/metrics").text,
                "through_kvmesh": TestClient(fronted).get("/metrics").text,
            }
        )
    )


if __name__ == "__main__":
    main()
