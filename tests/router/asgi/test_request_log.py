"""``--log-requests``: one line per request as its answer ends (kvmesh.router.asgi.request_log),
read as an operator reads it: through the standalone router in process, and from ``kvmesh
router``'s own stderr."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote

import aiohttp
import pytest

from kvmesh.mock.testing import RunningMock, run_mock
from kvmesh.router.asgi.standalone import build_router_app
from kvmesh.router.mesh.settings import MeshSettings, WorkerSpec
from tests.router.asgi.test_agent_features import BS
from tests.router.servers import serve

PROMPT = "Summarise the indemnity clause of the supplier contract in two sentences. " * 8


@contextlib.asynccontextmanager
async def fleet(log_requests: bool) -> AsyncIterator[tuple[str, list[RunningMock]]]:
    async with contextlib.AsyncExitStack() as stack:
        mocks = [await stack.enter_async_context(run_mock(block_size=BS, speedup=50.0)) for _ in range(2)]
        settings = MeshSettings(
            workers=tuple(WorkerSpec(m.base_url, m.base_url) for m in mocks),
            health_interval=0.2,
            log_requests=log_requests,
        )
        front = await stack.enter_async_context(serve(build_router_app(settings)))
        yield front.url, mocks


async def chat(http: aiohttp.ClientSession, front: str, **extra: Any) -> tuple[int, str | None, str]:
    body = {
        "model": "kvmesh-mock",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 6,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    async with http.post(front + "/v1/chat/completions", json=body) as r:
        return r.status, r.headers.get("x-kvmesh-worker-id"), await r.text()


def _fields(line: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in line.split() if "=" in part and not part.startswith("reason="))


async def test_each_request_is_one_line_saying_where_it_went_and_how(
    http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvmesh.requests")
    async with fleet(log_requests=True) as (front, _):
        status, worker, first = await chat(http, front)
        assert status == 200
        await asyncio.sleep(0.3)  # (the engine's KV events reach the router: the prompt is cached there)
        status, again, second = await chat(http, front)
        assert status == 200 and again == worker
        status, _, _ = await chat(http, front, nvext={"backend_instance_id": "nobody"})
        assert status == 400
    lines = [r.getMessage() for r in caplog.records if r.name == "kvmesh.requests"]
    assert len(lines) == 3, lines
    usage = [
        int(m) for m in re.findall(r'"cached_tokens":\s*(\d+)', first + second)
    ]  # (the engine's own counts, first then second)
    for line, reported in zip(lines[:2], usage, strict=True):
        assert line.startswith("POST /v1/chat/completions 200 forwarded "), line
        fields = _fields(line)
        assert fields["worker"] == worker
        assert fields["cached_reported"] == str(reported)
        assert int(fields["prompt_tokens"]) > 100 and fields["output_tokens"] == "6"
        assert float(fields["ttft_ms"]) <= float(fields["total_ms"])
        assert fields["request_id"]
    assert int(_fields(lines[1])["cached_predicted"]) > 0  # (the second found the first's blocks)
    assert lines[2].startswith("POST /v1/chat/completions 400 rejected "), lines[2]
    assert _fields(lines[2])["field"] == "nvext.backend_instance_id"
    assert lines[2].endswith("reason=\"unknown worker id 'nobody'\""), lines[2]
    assert all("indemnity" not in line for line in lines)  # (nothing of the prompt)


async def test_without_the_setting_nothing_is_logged(
    http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="kvmesh.requests")
    async with fleet(log_requests=False) as (front, _):
        assert (await chat(http, front))[0] == 200
    assert not [r for r in caplog.records if r.name == "kvmesh.requests"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_kvmesh_router_logs_requests_on_its_stderr(http: aiohttp.ClientSession) -> None:
    """The command's own log: ``--log-requests`` lines, and kvmesh's INFO messages, at the
    server's ``--log-level`` (before, only uvicorn's loggers had a handler)."""
    async with run_mock(block_size=BS, speedup=50.0) as mock:
        port = _free_port()
        front = f"http://127.0.0.1:{port}"
        argv = ["router", "--port", str(port), "--workers", mock.base_url, "--log-requests"]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvmesh", *argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        try:
            async with asyncio.timeout(30):
                while True:
                    with contextlib.suppress(aiohttp.ClientError):
                        async with http.get(front + "/health") as r:
                            if r.status == 200:
                                break
                    await asyncio.sleep(0.1)
            assert (await chat(http, front))[0] == 200
            async with http.delete(f"{front}/kvmesh/workers/{quote(mock.base_url, safe='')}") as r:
                assert r.status == 200, await r.text()
        finally:
            proc.terminate()
            _, err = await proc.communicate()
    log = err.decode()
    [line] = [x for x in log.splitlines() if "POST /v1/chat/completions" in x]
    assert line.startswith("INFO:") and f" 200 forwarded worker={mock.base_url} " in line, log[-2000:]
    assert f"worker {mock.base_url} removed" in log  # (one of kvmesh's INFO messages, once dropped)


_ONE_LINE = """
import logging, time
{setup}
from kvmesh.router.asgi.request_log import log_request
log_request("POST", "/v1/completions", "rejected", 400, time.perf_counter(), None, ("bad prompt", "prompt"))
"""


@pytest.mark.parametrize(
    "setup",
    [
        "",  # (vllm serve: only vLLM's loggers have a handler, and INFO went nowhere)
        "logging.basicConfig(level=logging.WARNING)",  # (a root handler: used, not doubled)
    ],
    ids=["no handler", "root handler"],
)
def test_the_lines_reach_stderr_once_however_the_host_logs(setup: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", _ONE_LINE.format(setup=setup)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    lines = [x for x in result.stderr.splitlines() if "POST /v1/completions 400 rejected" in x]
    assert len(lines) == 1, result.stderr
    assert "field=prompt" in lines[0]
