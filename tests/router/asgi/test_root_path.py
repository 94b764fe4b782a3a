"""Engines served under a root path (``vllm serve --root-path /llm``, SGLang's
``--fastapi-root-path``): uvicorn puts the root before every path the middleware sees, so matched on
the whole path no request was routed and the router's admin API (``/kvmesh/workers``) was a 404.
(The engine's own ``/kvmesh/`` RPC routes are the app's, which Starlette routes below the root.)"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from kvmesh._http import route_path
from kvmesh.commands.demo import start_mesh
from kvmesh.mock.config import MockConfig
from kvmesh.router.core.config import RouterConfig

MOCK = MockConfig(block_size=16, num_blocks=4096, speedup=20.0)
SHARED = "You are a careful assistant answering questions about the kvmesh router. " * 30


@pytest.mark.parametrize(
    ("path", "root", "routed_on"),
    [
        ("/llm/v1/chat/completions", "/llm", "/v1/chat/completions"),  # uvicorn --root-path
        ("/v1/chat/completions", "/llm", "/v1/chat/completions"),  # a proxy stripped it first
        ("/llm/v1/chat/completions", "/llm/", "/v1/chat/completions"),
        ("/llm", "/llm", "/"),
        ("/llmx/v1/chat/completions", "/llm", "/llmx/v1/chat/completions"),  # not below the root
        ("/v1/chat/completions", "", "/v1/chat/completions"),
        ("/v1/chat/completions", "/", "/v1/chat/completions"),
    ],
)
def test_route_path_is_the_path_below_the_root(path: str, root: str, routed_on: str) -> None:
    assert route_path({"path": path, "root_path": root}) == routed_on


async def _ask(http: aiohttp.ClientSession, url: str, text: str) -> str:
    body: dict[str, Any] = {
        "model": MOCK.model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 4,
        "nvext": {"extra_fields": ["worker_id"]},
    }
    async with http.post(url, json=body) as r:
        data = await r.json()
        assert r.status == 200, data
    return str(data["nvext"]["worker_id"]["decode_worker_id"])


@pytest.mark.parametrize(
    ("in_app", "roots"),
    [
        (False, ("",)),  # uvicorn's root path (SGLang): every path arrives with it
        (True, ("/llm", "")),  # FastAPI's (vLLM): asked with it, or through a proxy that strips it
    ],
)
async def test_a_mesh_served_under_a_root_path_routes_and_answers_its_peers(
    in_app: bool, roots: tuple[str, ...]
) -> None:
    async with (
        start_mesh(3, RouterConfig(), MOCK, root_path="/llm", root_path_in_app=in_app) as nodes,
        aiohttp.ClientSession() as http,
    ):
        # every replica reads its peers' /kvmesh/info and follows their events
        async with http.get(nodes[1].url + roots[0] + "/kvmesh/workers") as r:
            assert r.status == 200
            workers = (await r.json())["workers"]
        assert [w["state"] for w in workers] == ["up"] * 3
        assert {w["events"]["state"] for w in workers} == {"live"}
        async with http.get(nodes[1].url + roots[0] + "/kvmesh/info") as r:
            assert r.status == 200 and (await r.json())["kv_events_endpoints"]

        first = await _ask(http, nodes[0].url + roots[0] + "/v1/chat/completions", SHARED + "first")
        await asyncio.sleep(0.3)  # the engine's "stored" events reach every replica
        # asked on any replica, the prefix's holder serves: the request was routed, and forwarded
        # to a path the peer serves
        for i, node in enumerate(nodes):
            for root in roots:
                url = f"{node.url}{root}/v1/chat/completions"
                assert await _ask(http, url, SHARED + f"follow-up {i}{root}") == first
        assert [n.engine.steps > 0 for n in nodes] == [n.url == first for n in nodes]
