"""SageMaker's ``POST /invocations`` through the router, over HTTP, in front of ``kvmesh mock``
engines (which serve it as vLLM 0.33 does, stateful sessions on: kvmesh.mock.invocations).

A body that is a generation is routed on its prompt as the chat request or completion it is, and
reaches the engine on ``/invocations``; any other body goes to one worker unrouted; a request that
names a stateful session goes to the engine that opened it (kvmesh.router.asgi.invocations).
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from kvmesh.commands.demo import start_mesh
from kvmesh.mock.config import MockConfig
from kvmesh.router.core.config import RouterConfig
from tests.router.asgi.test_agent_features import BS, mock_fleet
from tests.router.asgi.test_responses_api import WORKER, indexed_as_stored

SESSION = "X-Amzn-SageMaker-Session-Id"
CONTRACT = "The contract's renewal clause, read line by line with its history of amendments. " * 10
MANUAL = "The pump's maintenance manual, section by section, with every torque value listed. " * 10


def chat(model: str, text: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 3, **extra}


def completion(model: str, text: str | list[str], **extra: Any) -> dict[str, Any]:
    return {"model": model, "prompt": text, "max_tokens": 3, **extra}


async def invoke(
    http: aiohttp.ClientSession, url: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, Any, Any]:
    """(status, the answer: JSON, a stream's events, or text; the answer's headers)."""
    async with http.post(url + "/invocations", json=body, headers=headers or {}) as r:
        raw = (await r.read()).decode()
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            events = [json.loads(e[6:]) for e in raw.split("\n\n") if e.startswith("data: {")]
            return r.status, events, r.headers
        try:
            return r.status, json.loads(raw), r.headers
        except ValueError:
            return r.status, raw, r.headers


async def warm(http: aiohttp.ClientSession, front: str, body: dict[str, Any], worker: str) -> None:
    """Cache ``body``'s prompt on ``worker`` alone (pinned), and wait until the router indexes it."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    pinned = {**body, "nvext": {"backend_instance_id": worker}}
    async with http.post(front + path, json=pinned) as r:
        assert r.status == 200, await r.text()
    await indexed_as_stored(http, front, worker)


async def served_count(http: aiohttp.ClientSession, front: str) -> float:
    """``kvmesh_requests_total`` of ``/invocations`` forwarded with a 200 (the registry is the
    process's: a test reads how much it grew)."""
    async with http.get(front + "/metrics") as r:
        text = await r.text()
    line = 'kvmesh_requests_total{endpoint="/invocations",route="forwarded",status="200"} '
    return next((float(x[len(line) :]) for x in text.splitlines() if x.startswith(line)), 0.0)


def cached_tokens(doc: dict[str, Any]) -> int:
    return int((doc["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


@pytest.mark.parametrize("kind", ["chat", "completion"])
async def test_an_invocation_goes_where_its_prompt_is_cached(http: aiohttp.ClientSession, kind: str) -> None:
    """Two prompts, each cached on its own engine: each invocation goes to its prompt's engine,
    and the engine reports the prompt cached. Before, the router answered 404 on /invocations."""
    make = chat if kind == "chat" else completion
    async with mock_fleet(2) as (front, mocks, _):
        model = mocks[0].config.model
        first, second = (m.base_url for m in mocks)
        await warm(http, front.url, make(model, CONTRACT), first)
        await warm(http, front.url, make(model, MANUAL), second)
        counted = await served_count(http, front.url)
        for text, home in ((CONTRACT, first), (MANUAL, second), (CONTRACT, first), (MANUAL, second)):
            status, doc, headers = await invoke(http, front.url, make(model, text))
            assert status == 200, doc
            assert headers[WORKER] == home
            assert cached_tokens(doc) >= 4 * BS
        # counted by the path the client used
        assert await served_count(http, front.url) == counted + 4


async def test_a_streamed_invocation_streams_from_the_cached_engine(http: aiohttp.ClientSession) -> None:
    async with mock_fleet(2) as (front, mocks, _):
        model = mocks[0].config.model
        home = mocks[1].base_url
        await warm(http, front.url, chat(model, CONTRACT), home)
        body = chat(model, CONTRACT, stream=True, stream_options={"include_usage": True})
        status, events, headers = await invoke(http, front.url, body)
        assert status == 200
        assert headers[WORKER] == home
        assert events[-1]["usage"]["completion_tokens"] == 3
        assert cached_tokens(events[-1]) >= 4 * BS


async def test_a_batch_of_prompts_is_routed_prompt_by_prompt(http: aiohttp.ClientSession) -> None:
    """A completion batch sent to /invocations is cut by prompt as on /v1/completions: each prompt
    goes where it is cached, and the answers come back as one completion."""
    async with mock_fleet(2) as (front, mocks, _):
        model = mocks[0].config.model
        first, second = (m.base_url for m in mocks)
        await warm(http, front.url, completion(model, CONTRACT), first)
        await warm(http, front.url, completion(model, MANUAL), second)
        status, doc, _ = await invoke(http, front.url, completion(model, [CONTRACT, MANUAL]))
        assert status == 200, doc
        assert [c["index"] for c in doc["choices"]] == [0, 1]
        assert cached_tokens(doc) >= 8 * BS  # (each prompt found cached where it went)


async def test_a_body_that_is_no_generation_is_relayed_and_bad_bodies_are_the_clients_400(
    http: aiohttp.ClientSession,
) -> None:
    async with mock_fleet(2) as (front, mocks, _):
        model = mocks[0].config.model
        status, doc, _ = await invoke(http, front.url, {"model": model, "input": ["a short query"]})
        assert status == 200, doc
        assert len(doc["data"]) == 1 and doc["data"][0]["embedding"]
        # the engine's own refusal of a body that fits no handler, relayed as it came
        status, doc, _ = await invoke(http, front.url, {"model": model, "question": "what?"})
        assert (status, doc["error"]["param"]) == (400, "body")
        # the router's: not a JSON object, or a chat request it cannot read
        for bad in ([1, 2], "text"):
            status, doc, _ = await invoke(http, front.url, bad)
            assert (status, doc["error"]["param"]) == (400, "body"), doc
        status, doc, _ = await invoke(http, front.url, {"model": model, "messages": "hello"})
        assert status == 400 and doc["error"]["param"].startswith("messages"), doc


async def test_a_sessions_requests_go_to_the_engine_that_opened_it(http: aiohttp.ClientSession) -> None:
    """A stateful session lives in one engine. Its requests reach it even when their prompt is
    cached elsewhere (another engine answers 400: no such session); after CLOSE the router forgets
    it, and the engine (reached on /invocations, which checks sessions) refuses the old id."""
    async with mock_fleet(2) as (front, mocks, app):
        model = mocks[0].config.model
        urls = [m.base_url for m in mocks]
        status, text, headers = await invoke(http, front.url, {"requestType": "NEW_SESSION"})
        assert status == 200, text
        session = headers["X-Amzn-SageMaker-New-Session-Id"].split(";")[0]
        opener = headers[WORKER]
        other = next(u for u in urls if u != opener)
        assert app.mesh.session_homes.home(session) == opener
        await warm(http, front.url, chat(model, CONTRACT), other)
        # without the session the prompt goes where it is cached (asked first: later, the session's
        # requests cache it on the opener too)
        status, doc, headers = await invoke(http, front.url, chat(model, CONTRACT))
        assert (status, headers[WORKER]) == (200, other)
        for body in (chat(model, CONTRACT), chat(model, CONTRACT, stream=True), completion(model, MANUAL)):
            status, doc, headers = await invoke(http, front.url, body, {SESSION: session})
            assert status == 200, doc
            assert headers[WORKER] == opener
        status, text, headers = await invoke(http, front.url, {"requestType": "CLOSE"}, {SESSION: session})
        assert status == 200, text
        assert headers["X-Amzn-SageMaker-Closed-Session-Id"] == session
        assert app.mesh.session_homes.home(session) is None
        status, doc, _ = await invoke(http, front.url, chat(model, CONTRACT), {SESSION: session})
        assert (status, doc["error"]["param"]) == (400, SESSION.lower())


async def test_a_session_pinned_elsewhere_is_the_clients_400(http: aiohttp.ClientSession) -> None:
    async with mock_fleet(2) as (front, mocks, _):
        model = mocks[0].config.model
        status, _, headers = await invoke(http, front.url, {"requestType": "NEW_SESSION"})
        session = headers["X-Amzn-SageMaker-New-Session-Id"].split(";")[0]
        other = next(m.base_url for m in mocks if m.base_url != headers[WORKER])
        body = chat(model, CONTRACT, nvext={"backend_instance_id": other})
        status, doc, _ = await invoke(http, front.url, body, {SESSION: session})
        assert (status, doc["error"]["param"]) == (400, SESSION.lower()), doc


async def test_inside_the_engines_an_invocation_is_routed_to_the_peer_that_caches_it(
    http: aiohttp.ClientSession,
) -> None:
    """Each engine embeds the router (a mesh): an invocation sent to one engine is served by the
    peer that holds its prompt, on the peer's own /invocations. A session opened at an engine
    stays there: its request is served where it was sent although its prompt is cached on a peer."""
    async with start_mesh(2, RouterConfig(), MockConfig(block_size=BS, speedup=50.0)) as nodes:
        entry, holder = (node.url for node in nodes)
        model = MockConfig().model
        await warm(http, entry, chat(model, CONTRACT), holder)
        status, doc, headers = await invoke(http, entry, chat(model, CONTRACT))
        assert status == 200, doc
        assert headers[WORKER] == holder
        assert cached_tokens(doc) >= 4 * BS
        status, text, headers = await invoke(http, entry, {"requestType": "NEW_SESSION"})
        assert status == 200, text
        session = headers["X-Amzn-SageMaker-New-Session-Id"].split(";")[0]
        status, doc, headers = await invoke(http, entry, chat(model, CONTRACT), {SESSION: session})
        assert status == 200, doc
        assert headers[WORKER] == entry
