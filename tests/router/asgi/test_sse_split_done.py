"""``data: [DONE]`` split across two TCP reads must still get the nvext echo *before* it.

The upstream flushes ``data: [DO`` and ``NE]\\n\\n`` separately, so the router's response tap
sees the terminator in two body chunks (the tap holds an unfinished line back until its end
arrives).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from kvmesh.router.asgi.standalone import build_router_app
from kvmesh.router.core.config import RouterConfig
from kvmesh.router.mesh.settings import MeshSettings, WorkerSpec
from tests.router.servers import read_completion_request, serve

CHUNK = {"id": "c1", "object": "chat.completion.chunk", "model": "m", "choices": [{"index": 0, "delta": {"content": "hi"}}]}  # fmt: skip


async def split_done_upstream(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """A raw ASGI engine whose stream ends with ``[DONE]`` cut in two separate writes."""
    if not await read_completion_request(scope, receive, send):
        return
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
    )
    await send(
        {"type": "http.response.body", "body": f"data: {json.dumps(CHUNK)}\n\n".encode(), "more_body": True}
    )
    await asyncio.sleep(0.05)
    await send({"type": "http.response.body", "body": b"data: [DO", "more_body": True})
    await asyncio.sleep(0.05)  # a separate TCP segment, read separately by the router
    await send({"type": "http.response.body", "body": b"NE]\n\n", "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def test_nvext_echo_precedes_a_done_marker_split_across_reads() -> None:
    async with serve(split_done_upstream) as upstream, aiohttp.ClientSession() as http:
        settings = MeshSettings(
            workers=(WorkerSpec(upstream.url, "u"),), router=RouterConfig(router_mode="round-robin")
        )
        async with serve(build_router_app(settings)) as front:
            body = {
                "model": "m",
                "stream": True,
                "messages": [{"role": "user", "content": "hi"}],
                "nvext": {"extra_fields": ["worker_id"]},
            }
            async with http.post(front.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
                text = (await r.read()).decode()
    events = [e for e in text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert text.count("[DONE]") == 1
    echoed = [json.loads(e[len("data: ") :]) for e in events[:-1] if '"nvext"' in e]
    assert [e["nvext"]["worker_id"]["decode_worker_id"] for e in echoed] == ["u"]
