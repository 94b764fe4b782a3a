"""examples/fastapi_app.py: two copies of an ordinary FastAPI app route among themselves."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import aiohttp

from tests.router.servers import bound_socket, serve

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "fastapi_app.py"


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvmesh_example_fastapi_app", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


async def test_two_fastapi_replicas_route_a_shared_prefix_to_one_of_them() -> None:
    example = _example()
    socks = [bound_socket(), bound_socket()]
    urls = [f"http://127.0.0.1:{s.getsockname()[1]}" for s in socks]
    prompt = "Summarise the kvmesh design document for a new engineer. " * 20
    async with contextlib.AsyncExitStack() as stack:
        for sock, url in zip(socks, urls, strict=True):
            await stack.enter_async_context(serve(example.create_app(url, ",".join(urls)), sock))
        http = await stack.enter_async_context(aiohttp.ClientSession())
        for (
            url
        ) in urls:  # a replica that started before its peer listened re-admits it on the next health check
            for _ in range(100):
                async with http.get(url + "/kvmesh/workers") as r:
                    if [w["state"] for w in (await r.json())["workers"]] == ["up", "up"]:
                        break
                await asyncio.sleep(0.05)
        served = []
        for i in range(6):
            body = {
                "model": "toy",
                "messages": [{"role": "user", "content": prompt + f" (ask {i})"}],
                "nvext": {"extra_fields": ["worker_id"]},
            }
            async with http.post(urls[i % 2] + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
                doc = await r.json()
            assert (
                doc["choices"][0]["message"]["content"]
                == f"served by {doc['nvext']['worker_id']['decode_worker_id']}"
            )
            served.append(doc["nvext"]["worker_id"]["decode_worker_id"])
        # each replica learned where it sent the prefix and keeps sending it there
        assert served[2:] == served[:2] * 2
        # a pinned request asked at one replica is served by the other
        body = {"model": "toy", "messages": [{"role": "user", "content": "hi"}]}
        async with http.post(
            urls[0] + "/v1/chat/completions", json=body, headers={"x-worker-instance-id": urls[1]}
        ) as r:
            assert (await r.json())["choices"][0]["message"]["content"] == f"served by {urls[1]}"
        async with http.get(urls[0] + "/kvmesh/workers") as r:
            assert [w["state"] for w in (await r.json())["workers"]] == ["up", "up"]
