"""A session opened without a timeout lives as long as ``--router-session-timeout-secs`` says, on
the router and on the worker that holds its blocks; a client's own timeout still wins."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from kvmesh.mock.testing import run_mock
from kvmesh.router.asgi.standalone import build_router_app
from kvmesh.router.core.config import RouterConfig
from kvmesh.router.mesh.settings import MeshSettings, WorkerSpec
from tests.router.servers import serve


@pytest.mark.parametrize(
    ("client_timeout", "held_for"), [(None, 42.0), (30, 30.0)], ids=["default", "client"]
)
async def test_an_opened_session_gets_the_configured_timeout(
    http: aiohttp.ClientSession, client_timeout: float | None, held_for: float
) -> None:
    async with run_mock(block_size=16, speedup=50.0) as mock:
        settings = MeshSettings(
            workers=(WorkerSpec(mock.base_url, mock.base_url),),
            router=RouterConfig(router_session_timeout_secs=42.0),
        )
        async with serve(build_router_app(settings)) as front:
            control: dict[str, Any] = {"session_id": "s-1", "action": "open"}
            if client_timeout is not None:
                control["timeout"] = client_timeout
            body = {
                "model": mock.config.model,
                "messages": [{"role": "user", "content": "a conversation that will go on " * 8}],
                "max_tokens": 2,
                "nvext": {"session_control": control},
            }
            async with http.post(front.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
            sessions = mock.engine.retention.sessions
            for _ in range(250):  # the open_session RPC is sent beside the request
                if "s-1" in sessions:
                    break
                await asyncio.sleep(0.02)
            assert dict(sessions) == {"s-1": held_for}
