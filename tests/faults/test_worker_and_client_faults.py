"""Workers killed and clients leaving at every moment, against the standalone router in front of
real mock engines: no request that could have been served is lost, nothing keeps running on an
engine without its client, the router's load goes back to 0, and each fault is counted."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvmesh.mock.config import MockConfig
from tests.faults.rig import Rig, rig, until

SLOW = {"speedup": 1.0}  # real-time steps: a long answer runs for seconds


def _body(text: str, **extra: object) -> bytes:
    doc = {"model": MockConfig().model, "messages": [{"role": "user", "content": text}], **extra}
    return json.dumps(doc).encode()


async def _holder(r: Rig) -> int:
    """The engine running something (the one to kill)."""
    await until(lambda: r.engine_running() > 0)
    return next(i for i, e in enumerate(r.engines) if e.engine.scheduler.num_running)


async def test_a_worker_killed_before_its_first_byte_is_replaced() -> None:
    async with rig(2, **SLOW) as r:
        # non-streaming: no byte reaches the router before the whole answer
        body = {
            "model": MockConfig().model,
            "messages": [{"role": "user", "content": "long"}],
            "max_tokens": 400,
        }
        task = asyncio.create_task(r.http.post(r.front.url + "/v1/chat/completions", json=body))
        victim = await _holder(r)
        await r.engines[victim].crash()
        response = await task
        assert response.status == 200, await response.text()  # served by the survivor
        response.release()
        assert "kvmesh_failovers_total" in await r.metrics()
        assert await r.load() == 0


async def test_a_worker_killed_mid_stream_ends_the_stream_cleanly() -> None:
    async with rig(2, **SLOW) as r:
        body = {
            "model": MockConfig().model,
            "messages": [{"role": "user", "content": "long"}],
            "max_tokens": 400,
            "stream": True,
        }
        async with r.http.post(r.front.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            first = await resp.content.readuntil(b"\n\n")
            assert first.startswith(b"data: ")
            victim = await _holder(r)
            await r.engines[victim].crash()
            rest = await resp.read()
        assert b'"type":"UpstreamError"' in rest  # an error event, not a silent cut
        await until(lambda: _zero_load(r))


async def _zero_load(r: Rig) -> bool:
    return await r.load() == 0


@pytest.mark.parametrize(
    "moment",
    ["head-only", "mid-body", "after-body-0ms", "after-body-1ms", "after-body-10ms", "after-first-byte"],
)
async def test_a_client_leaving_at_any_moment_leaves_no_work_behind(moment: str) -> None:
    async with rig(2, **SLOW) as r:
        host, port = r.front.url.removeprefix("http://").split(":")
        for i in range(3):
            body = _body(f"fire and forget {moment} {i}", max_tokens=2000 + i, stream=i % 2 == 0)
            head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            head += b"content-length: %d\r\n\r\n" % len(body)
            reader, writer = await asyncio.open_connection(host, int(port))
            if moment == "head-only":
                writer.write(head)
            elif moment == "mid-body":
                writer.write(head + body[: len(body) // 2])
            else:
                writer.write(head + body)
            await writer.drain()
            if moment == "after-body-1ms":
                await asyncio.sleep(0.001)
            elif moment == "after-body-10ms":
                await asyncio.sleep(0.01)
            elif moment == "after-first-byte":
                await reader.read(1)
            writer.transport.abort()
        # Every copy was aborted on the engine (a lost cancellation once left some running there).
        await until(lambda: r.engine_running() == 0)
        await until(lambda: _zero_load(r))
        assert "kvmesh_requests_total" in await r.metrics()
