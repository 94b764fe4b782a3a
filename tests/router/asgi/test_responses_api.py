"""``POST /v1/responses`` through a standalone router in front of mock engines, over HTTP.

The mock serves the Responses API as vLLM 0.33.0 does with its store on (kvmesh.mock.responses).
A Responses request is routed on the prompt the engine renders it as, the same prompt as the chat
request with the same messages, so the two share cached blocks; the router reads the answer (its
first token after the lifecycle events, its usage in the Responses API's names) and frees its load;
``previous_response_id`` goes to the engine that stored that response, the only one that has it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from kvmesh.commands.demo import start_mesh
from kvmesh.hashing import block_hashes
from kvmesh.mock.config import MockConfig
from kvmesh.mock.testing import RunningMock, run_mock
from kvmesh.router.core.config import RouterConfig
from kvmesh.router.request.tokenizer import prompt_token_ids
from tests.router.asgi.test_agent_features import BS, mock_fleet, until

SYSTEM = "You are a careful assistant who answers with citations. " * 12
WORKER = "x-kvmesh-worker-id"


async def respond(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> tuple[int, dict[str, Any], str | None]:
    """(status, the whole response object or the error, the worker that served it); a stream is
    read to its ``response.completed`` event."""
    async with http.post(url + "/v1/responses", json=body) as r:
        worker = r.headers.get(WORKER)
        if r.status != 200 or not body.get("stream"):
            return r.status, await r.json(), worker
        raw = (await r.read()).decode()
    done = [e for e in raw.split("\n\n") if e.startswith("event: response.completed")]
    assert len(done) == 1, raw[-500:]
    return 200, json.loads(done[0].split("data: ", 1)[1])["response"], worker


FOLLOW_TEXT = "Now compare it with the termination clause, point by point. " * 6


async def warm_elsewhere(http: aiohttp.ClientSession, url: str, model: str, worker: str) -> None:
    """Cache the follow-up's own words (:data:`FOLLOW_TEXT`) on ``worker`` alone, one that does not
    hold the stored response: a follow-up routed on its own words would go there (and get a 404)."""
    warm = {"model": model, "prompt": FOLLOW_TEXT, "max_tokens": 1, "nvext": {"backend_instance_id": worker}}
    async with http.post(url + "/v1/completions", json=warm) as r:
        assert r.status == 200


def cached(doc: dict[str, Any]) -> int:
    return int(doc["usage"]["input_tokens_details"]["cached_tokens"])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_responses_turn_goes_where_its_chat_twin_is_cached(
    http: aiohttp.ClientSession, stream: bool
) -> None:
    async with mock_fleet(3) as (front, mocks, app):
        model = mocks[0].config.model
        question = "What does the second clause of the contract say about renewals? " * 4
        chat = {
            "model": model,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            "max_tokens": 4,
        }
        async with http.post(front.url + "/v1/chat/completions", json=chat) as r:
            assert r.status == 200
            home = r.headers[WORKER]
        await until(lambda: any(app.mesh.router.holds_any(h) for h in _hashes(app, chat)))
        body = {
            "model": model,
            "instructions": SYSTEM,
            "input": question,
            "max_output_tokens": 4,
            "stream": stream,
        }
        reported_before = await reported_cached(http, front.url, home)
        status, doc, worker = await respond(http, front.url, body)
        assert status == 200, doc
        assert worker == home
        prompt = doc["usage"]["input_tokens"]
        assert cached(doc) == (prompt - 1) // BS * BS  # every whole block but the last token's
        # The router read the answer: the load it counted is gone, its prediction was right.
        decision = app.mesh.router.recent_decisions(1)[-1][1]
        assert decision.cached_tokens == cached(doc)
        await until(lambda: not app.mesh.router.tracking(decision.request_id))
        # ... and took the engine's count of cached tokens from the Responses API's usage
        assert await reported_cached(http, front.url, home) == reported_before + cached(doc)


async def reported_cached(http: aiohttp.ClientSession, url: str, worker: str) -> float:
    """The router's count of the cached tokens ``worker``'s engine reported, from its /metrics."""
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    line = f'kvmesh_cached_tokens_reported_total{{worker="{worker}"}} '
    return sum(float(x[len(line) :]) for x in text.splitlines() if x.startswith(line))


async def twin_served(
    http: aiohttp.ClientSession, url: str, app: Any, path: str, body: dict[str, Any]
) -> tuple[str, float]:
    """Serve ``body`` at ``path`` once through the router at ``url`` (whose app is ``app``): the
    worker that served it, once the router has let the request go, and that worker's count of
    reported cached tokens then (a later request's twin is cached there)."""
    async with http.post(url + path, json=body) as r:
        assert r.status == 200, await r.text()
        home = r.headers[WORKER]
    first = app.mesh.router.recent_decisions(1)[-1][1]
    await until(lambda: not app.mesh.router.tracking(first.request_id))
    await indexed_as_stored(http, url, home)
    return home, await reported_cached(http, url, home)


async def indexed_as_stored(http: aiohttp.ClientSession, url: str, worker: str, tries: int = 250) -> None:
    """Wait until the router at ``url`` indexes as many blocks on ``worker`` as its engine stored.

    The answer and the engine's KV events travel apart, so under load the answer can arrive first;
    a request routed in that gap sees no cached prefix anywhere."""
    for _ in range(tries):
        async with http.get(worker + "/kvmesh/kv_state") as r:
            events = (await r.json())["ranks"][0]["events"]
        stored = sum(len(e["block_hashes"]) for e in events if e["type"] == "BlockStored")
        async with http.get(url + "/kvmesh/workers") as r:
            rows = {row["worker_id"]: row for row in (await r.json())["workers"]}
        if stored and rows[worker]["indexed_blocks"] == stored:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"the router never indexed what {worker} stored")


def _hashes(app: Any, chat: dict[str, Any]) -> list[int]:
    return block_hashes(prompt_token_ids(app.mesh.tokenizer, chat, "chat"), BS, None)


async def test_a_later_response_goes_to_the_engine_that_stored_the_earlier_one(
    http: aiohttp.ClientSession,
) -> None:
    async with mock_fleet(2) as (front, mocks, _):
        model = mocks[0].config.model
        first_id, second_id = mocks[0].base_url, mocks[1].base_url
        opening = {
            "model": model,
            "instructions": SYSTEM,
            "input": "Summarise the renewal clause.",
            "max_output_tokens": 8,
            "nvext": {"backend_instance_id": first_id},
        }
        status, earlier, worker = await respond(http, front.url, opening)
        assert status == 200 and worker == first_id
        await warm_elsewhere(http, front.url, model, second_id)
        follow = {
            "model": model,
            "instructions": SYSTEM,
            "input": FOLLOW_TEXT,
            "max_output_tokens": 4,
            "previous_response_id": earlier["id"],
        }
        for stream in (False, True):
            status, later, worker = await respond(http, front.url, {**follow, "stream": stream})
            assert status == 200, later
            assert worker == first_id
            assert later["previous_response_id"] == earlier["id"]
            assert cached(later) >= len(SYSTEM) // 8  # the stored conversation was cached there
        # Named together with another worker: the client's mistake, named.
        clash = {**follow, "nvext": {"backend_instance_id": second_id}}
        status, error, _ = await respond(http, front.url, clash)
        assert status == 400
        assert error["error"]["param"] == "previous_response_id"


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"background": True}, "background"),
        ({"input": None}, "input"),
        ({"input": []}, "input"),
        ({"input": [{"type": "web_search_call", "id": "ws"}]}, "input[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_text", "text": 3}]}]},
            "input[0].content[0].text",
        ),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
        ({"input": [{"role": ["user"], "content": "x"}]}, "input[0].role"),
        ({"input": [{"role": "assistant", "content": "x", "status": ["in_progress"]}]}, None),
        ({"instructions": ["x"]}, "instructions"),
        ({"tools": [{"type": "function"}]}, "tools[0].name"),
        ({"previous_response_id": 7}, "previous_response_id"),
        ({"nvext": {"cache_control": {"type": "ephemeral", "ttl": "5m"}}}, "nvext.cache_control"),
        ({"nvext": {"agent_hints": {"speculative_prefill": True}}}, "nvext.agent_hints.speculative_prefill"),
        ({"stream": True, "nvext": {"extra_fields": ["worker_id"]}}, "nvext.extra_fields"),
    ],
)
async def test_what_a_router_cannot_follow_is_refused_naming_the_field(
    http: aiohttp.ClientSession, extra: dict[str, Any], field: str | None
) -> None:
    async with mock_fleet(router=RouterConfig(enable_cache_control=True)) as (front, mocks, app):
        body = {"model": mocks[0].config.model, "input": "hello", "max_output_tokens": 2, **extra}
        status, error, _ = await respond(http, front.url, body)
        if field is None:  # (a status of a shape no engine reads: nothing is continued)
            assert status == 200, error
            return
        assert status == 400, error
        assert error["error"]["param"] == field
        assert not app.mesh.router.recent_decisions()  # nothing was routed


async def test_a_stored_response_is_fetched_from_the_engine_that_stored_it(
    http: aiohttp.ClientSession,
) -> None:
    async with mock_fleet(2) as (front, mocks, _):
        body = {"model": mocks[0].config.model, "input": "Name a river.", "max_output_tokens": 4}
        status, stored, worker = await respond(
            http, front.url, {**body, "nvext": {"backend_instance_id": mocks[1].base_url}}
        )
        assert status == 200 and worker == mocks[1].base_url
        async with http.get(f"{front.url}/v1/responses/{stored['id']}") as r:
            assert r.status == 200
            again = await r.json()
        assert (again["id"], again["output"]) == (stored["id"], stored["output"])
        async with http.get(front.url + "/v1/responses/resp_nobody") as r:
            assert r.status == 404
            assert (await r.json())["error"]["param"] == "response_id"
        # What follows the id is the client's, sent on as it was written (the engine has no such path)
        async with http.get(f"{front.url}/v1/responses/{stored['id']}/odd%20part") as r:
            assert r.status == 404, await r.text()
    # Inside the engines: asked of one engine, answered by the one that stored it.
    async with start_mesh(2, RouterConfig(), MockConfig(block_size=BS, speedup=50.0)) as nodes:
        here, there = nodes[0].url, nodes[1].url
        pinned = {**body, "model": MockConfig().model, "nvext": {"backend_instance_id": there}}
        status, stored, worker = await respond(http, here, pinned)
        assert status == 200 and worker == there
        async with http.get(f"{here}/v1/responses/{stored['id']}") as r:
            assert r.status == 200, await r.text()
            assert (await r.json())["id"] == stored["id"]
        async with http.get(f"{here}/v1/responses/resp_nobody") as r:
            assert r.status == 404  # unknown to the router: this engine's own store answers


@contextlib.asynccontextmanager
async def engine_added(http: aiohttp.ClientSession, front: str, worker_id: str) -> AsyncIterator[RunningMock]:
    """A mock engine added to the router at ``front`` as ``worker_id`` while inside (then stopped:
    the worker goes down)."""
    async with run_mock(block_size=BS, speedup=50.0, seed=1) as added:
        async with http.post(front + "/kvmesh/workers", json={"url": added.base_url, "id": worker_id}) as r:
            assert r.status == 201, await r.text()
        yield added


async def test_a_later_response_whose_engine_is_down_is_a_503_naming_the_field(
    http: aiohttp.ClientSession,
) -> None:
    async with mock_fleet(1) as (front, mocks, app):
        async with engine_added(http, front.url, "gone") as gone:
            body = {"model": gone.config.model, "input": "Name a lake.", "max_output_tokens": 2}
            status, stored, worker = await respond(
                http, front.url, {**body, "nvext": {"backend_instance_id": "gone"}}
            )
            assert status == 200 and worker == "gone"
        await until(lambda: "gone" not in app.mesh.registry.routable)
        status, error, _ = await respond(http, front.url, {**body, "previous_response_id": stored["id"]})
        assert status == 503, error
        assert error["error"]["param"] == "previous_response_id"
        status, _, worker = await respond(http, front.url, body)  # the fleet serves the rest
        assert status == 200 and worker == mocks[0].base_url


async def test_a_replica_that_did_not_relay_a_response_finds_the_engine_holding_it(
    http: aiohttp.ClientSession,
) -> None:
    """In a mesh every engine's middleware is a router of its own, and a client behind a load
    balancer reaches any of them: the next turn comes in where the first was not routed."""
    async with start_mesh(3, RouterConfig(), MockConfig(block_size=BS, speedup=50.0)) as nodes:
        first, second, holder = (node.url for node in nodes)
        model = MockConfig().model

        async def stored_on_holder(text: str) -> str:
            body = {
                "model": model,
                "input": text,
                "max_output_tokens": 4,
                "nvext": {"backend_instance_id": holder},
            }
            status, stored, worker = await respond(http, first, body)
            assert status == 200 and worker == holder
            return str(stored["id"])

        fetched = await stored_on_holder("Summarise the renewal clause.")
        async with http.get(f"{second}/v1/responses/{fetched}") as r:  # a replica that never saw it
            assert r.status == 200, await r.text()
            assert (await r.json())["id"] == fetched
        continued = await stored_on_holder("Summarise the payment clause.")
        await warm_elsewhere(http, second, model, first)
        follow = {
            "model": model,
            "input": FOLLOW_TEXT,
            "max_output_tokens": 2,
            "previous_response_id": continued,
        }
        status, later, worker = await respond(http, second, follow)
        assert status == 200, later
        assert worker == holder
