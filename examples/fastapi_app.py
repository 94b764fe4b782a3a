"""An existing FastAPI app gains KV-aware routing by mounting ``KvMeshMiddleware``.

The app is a toy OpenAI-compatible "engine" (it answers with its own URL). Run two or more copies;
each one is a router replica and a worker at once, and they route among themselves:

    python examples/fastapi_app.py --port 8001 --workers http://127.0.0.1:8001,http://127.0.0.1:8002
    python examples/fastapi_app.py --port 8002 --workers http://127.0.0.1:8001,http://127.0.0.1:8002

    curl -s http://127.0.0.1:8001/v1/chat/completions -H 'content-type: application/json' \\
      -d '{"model": "toy", "messages": [{"role": "user", "content": "hello"}],
           "nvext": {"extra_fields": ["worker_id"]}}'
    curl -s http://127.0.0.1:8001/kvmesh/workers

The toy engine publishes no KV events, so the replicas run kvmesh's approximate mode: each one
remembers where it sent which prefix (``use_kv_events=False``). A real engine would publish events
(see examples/custom_engine_publisher.py) and serve ``/kvmesh/info``.
"""

from __future__ import annotations

import argparse

from fastapi import FastAPI, Request

from kvmesh.router import KvMeshMiddleware
from kvmesh.router.core.config import RouterConfig
from kvmesh.router.settings import MeshSettings, parse_worker_list


def create_app(self_url: str, workers: str) -> FastAPI:
    app = FastAPI(title="toy engine")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict[str, object]:
        body = await request.json()
        words = sum(len(str(m.get("content", "")).split()) for m in body.get("messages", []))
        return {
            "id": "chatcmpl-toy",
            "object": "chat.completion",
            "model": body.get("model", "toy"),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": f"served by {self_url}"}}],
            "usage": {"prompt_tokens": words, "completion_tokens": 3, "total_tokens": words + 3},
        }

    @app.get("/v1/models")
    async def models() -> dict[str, object]:
        return {"object": "list", "data": [{"id": "toy", "object": "model"}]}

    settings = MeshSettings(
        workers=parse_worker_list(workers),
        self_url=self_url,
        router=RouterConfig(use_kv_events=False),  # no events: learn from our own routing decisions
    )
    app.add_middleware(KvMeshMiddleware, settings=settings)
    return app


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--workers", required=True, help="every replica's URL, this one included")
    args = parser.parse_args()
    uvicorn.run(create_app(f"http://{args.host}:{args.port}", args.workers), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
