"""Bodies a hostile or broken client sends, against the standalone router over loopback HTTP: each
is a 4xx whose ``param`` names the field (these were 500s), and the router stays healthy with its
load back to 0."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from kvmesh.router.core.config import RouterConfig
from tests.router.fleet import chat, fleet
from tests.router.servers import wait_until

HUGE_INT = "1" + "0" * 400  # a JSON integer literal above every float (1.8e308)


def nvext_body(nvext: str) -> bytes:
    return (
        b'{"model":"test-model","messages":[{"role":"user","content":"hi"}],"nvext":' + nvext.encode() + b"}"
    )


def nested(depth: int) -> bytes:
    return (
        b'{"model":"test-model","messages":[{"role":"user","content":"hi"}],"metadata":'
        + b"[" * depth
        + b"]" * depth
        + b"}"
    )


CASES = [
    pytest.param(
        b'{"model":"test-model","messages":[{"role":"user","content":"caf\xc3\x28 \xff"}]}',
        "body",
        id="bad-utf8",
    ),
    pytest.param(nested(1000), "body", id="nested-1000"),
    pytest.param(nested(100), "metadata", id="nested-100"),
    pytest.param(
        nvext_body('{"agent_hints":{"kv_overlap_score_credit":' + HUGE_INT + "}}"),
        "nvext.agent_hints.kv_overlap_score_credit",
        id="huge-credit",
    ),
    pytest.param(
        nvext_body('{"agent_hints":{"latency_sensitivity":' + HUGE_INT + "}}"),
        "nvext.agent_hints.latency_sensitivity",
        id="huge-sensitivity",
    ),
    pytest.param(
        nvext_body('{"session_control":{"session_id":"s","timeout":' + HUGE_INT + "}}"),
        "nvext.session_control.timeout",
        id="huge-timeout",
    ),
    pytest.param(
        nvext_body('{"agent_hints":{"priority":' + "9" * 300 + "}}"),
        "nvext.agent_hints.priority",
        id="huge-priority",
    ),
    pytest.param(
        nvext_body('{"agent_hints":{"osl":' + "9" * 40 + "}}"), "nvext.agent_hints.osl", id="huge-osl"
    ),
    pytest.param(
        nvext_body('{"session_control":{"session_id":"s","action":["open"]}}'),
        "nvext.session_control.action",
        id="action-list",
    ),
    pytest.param(
        nvext_body('{"session_control":{"session_id":"s","action":{"a":1}}}'),
        "nvext.session_control.action",
        id="action-dict",
    ),
    pytest.param(
        nvext_body('{"session_control":{"session_id":"' + "x" * 4096 + '"}}'),
        "nvext.session_control.session_id",
        id="session-id-too-long",
    ),
    pytest.param(  # (it was sent on as the X-Session-ID header: a 500 from kvmesh's HTTP client)
        nvext_body('{"session_control":{"session_id":"a\\r\\nx-evil: 1","action":"open"}}'),
        "nvext.session_control.session_id",
        id="session-id-crlf",
    ),
    pytest.param(  # (the engine's server refused the forwarded request: a 400 that is no OpenAI error)
        nvext_body('{"session_control":{"session_id":"\\u001f"}}'),
        "nvext.session_control.session_id",
        id="session-id-control",
    ),
    pytest.param(
        nvext_body('{"session_control":{"session_id":"s","timeout":1e300}}'),
        "nvext.session_control.timeout",
        id="timeout-ceiling",
    ),
]


async def _health(http: aiohttp.ClientSession, front: str) -> int:
    async with http.get(front + "/kvmesh/workers") as r:
        assert r.status == 200
        return sum(row["active_requests"] for row in (await r.json())["workers"])


@pytest.mark.parametrize(("raw", "field"), CASES)
async def test_bad_input_is_a_4xx_naming_the_field(
    http: aiohttp.ClientSession, raw: bytes, field: str
) -> None:
    async with fleet(1) as (front, states, _):
        async with http.post(
            front.url + "/v1/chat/completions", data=raw, headers={"content-type": "application/json"}
        ) as r:
            doc = await r.json()
            assert r.status == 400, doc
        assert doc["error"]["param"] == field, doc
        assert states[0].received == []
        assert await _health(http, front.url) == 0


async def test_the_largest_priority_queues_and_is_served(http: aiohttp.ClientSession) -> None:
    """A priority at the bound is accepted; queued, its key must not overflow (it did: 500)."""
    config = RouterConfig(use_kv_events=False, router_queue_threshold=0.0)
    async with fleet(1, router=config, engine_kwargs={"chunks": 3, "gap": 0.2}) as (front, states, _):
        first = asyncio.create_task(_chat(http, front.url, chat("long " * 50, stream=True)))
        await wait_until(lambda: states[0].active == 1)
        top = {"agent_hints": {"priority": 2**31 - 1, "latency_sensitivity": 1e300}}
        status, _ = await _chat(http, front.url, chat("second " * 50, nvext=top))
        assert status == 200
        assert (await first)[0] == 200
        assert await _health(http, front.url) == 0


async def _chat(http: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, str]:
    async with http.post(url + "/v1/chat/completions", json=body) as r:
        return r.status, await r.text()


async def test_a_body_that_stalls_after_the_head_gets_408(http: aiohttp.ClientSession) -> None:
    async with fleet(1, body_read_timeout=0.3) as (front, states, _):
        host, port = front.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b'POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{"model"')
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 408"), head
        writer.close()
        assert states[0].received == []
        assert await _health(http, front.url) == 0
