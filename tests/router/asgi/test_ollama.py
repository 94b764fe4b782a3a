"""Ollama's ``/api/chat`` and ``/api/generate`` (as SGLang serves them) through the router, over
HTTP, in front of ``kvmesh mock`` engines (which serve them as SGLang 0.5.23 does:
kvmesh.mock.ollama).

A request is routed on its prompt, read as SGLang renders it (kvmesh.router.request.ollama_api),
reaches the engine on its own path, and its newline-delimited stream comes back line for line, with
its first token seen by the router."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from kvmesh.commands.demo import start_mesh
from kvmesh.mock.config import MockConfig
from kvmesh.router.core.config import RouterConfig
from tests.router.asgi.test_agent_features import BS, mock_fleet
from tests.router.asgi.test_invocations import CONTRACT, MANUAL, chat, completion, warm
from tests.router.asgi.test_responses_api import WORKER


def ollama_chat(text: str, **extra: Any) -> dict[str, Any]:
    """A one-message chat, three tokens long (``model`` is required and not read)."""
    messages = [{"role": "user", "content": text}]
    return {"model": "any", "messages": messages, "options": {"num_predict": 3}, **extra}


def ollama_generate(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": "any", "prompt": text, "options": {"num_predict": 3}, **extra}


async def ask(http: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any, Any]:
    """(status, the answer: its JSON object, or a stream's lines decoded; the answer's headers)."""
    path = "/api/chat" if isinstance(body, dict) and "messages" in body else "/api/generate"
    async with http.post(url + path, json=body) as r:
        raw = await r.read()
        if r.headers.get("content-type", "").startswith("application/x-ndjson"):
            assert raw.endswith(b"\n")
            return r.status, [json.loads(line) for line in raw.splitlines()], r.headers
        return r.status, json.loads(raw), r.headers


async def first_tokens_seen(http: aiohttp.ClientSession, front: str) -> float:
    """How many first tokens of streamed answers the router has timed (the process's registry: a
    test reads how much it grew)."""
    async with http.get(front + "/metrics") as r:
        text = await r.text()
    line = "kvmesh_time_to_first_token_seconds_count "
    return next((float(x[len(line) :]) for x in text.splitlines() if x.startswith(line)), 0.0)


@pytest.mark.parametrize("kind", ["chat", "generate"])
async def test_an_ollama_request_goes_where_its_prompt_is_cached(
    http: aiohttp.ClientSession, kind: str
) -> None:
    """Two prompts, each cached on its own engine by an OpenAI request: each Ollama request goes to
    its prompt's engine, since SGLang renders both the same way. Before, the router answered 404."""
    ours, theirs = (ollama_chat, chat) if kind == "chat" else (ollama_generate, completion)
    async with mock_fleet(2) as (front, mocks, _):
        model = mocks[0].config.model
        first, second = (m.base_url for m in mocks)
        await warm(http, front.url, theirs(model, CONTRACT), first)
        await warm(http, front.url, theirs(model, MANUAL), second)
        for text, home in ((CONTRACT, first), (MANUAL, second), (CONTRACT, first)):
            status, doc, headers = await ask(http, front.url, ours(text, stream=False))
            assert status == 200, doc
            assert headers[WORKER] == home
            assert doc["done"] is True and doc["eval_count"] == 3
            assert doc["prompt_eval_count"] > 4 * BS


async def test_a_stream_comes_back_line_for_line_and_its_first_token_is_timed(
    http: aiohttp.ClientSession,
) -> None:
    """Ollama streams unless told not to: newline-delimited JSON, a line a piece, then the done
    line. The router passes it on as it came and times its first token (it read none before: the
    stream is not SSE)."""
    async with mock_fleet(2) as (front, mocks, _):
        model = mocks[0].config.model
        home = mocks[1].base_url
        await warm(http, front.url, chat(model, CONTRACT), home)
        timed = await first_tokens_seen(http, front.url)
        status, lines, headers = await ask(http, front.url, ollama_chat(CONTRACT))
        assert status == 200
        assert headers[WORKER] == home
        assert [line["done"] for line in lines] == [False, False, False, True]
        assert all(line["message"]["content"] for line in lines[:-1])
        assert lines[-1]["done_reason"] == "stop"
        assert await first_tokens_seen(http, front.url) == timed + 1


async def test_an_empty_generate_prompt_is_answered_done(http: aiohttp.ClientSession) -> None:
    """Ollama's clients send an empty prompt to load a model: the engine answers it at once."""
    async with mock_fleet(2) as (front, _, _):
        status, lines, _ = await ask(http, front.url, {"model": "any", "prompt": ""})
        assert status == 200
        assert [(line["done"], line["response"]) for line in lines] == [(True, "")]
        status, doc, _ = await ask(http, front.url, {"model": "any", "prompt": "  ", "stream": False})
        assert (status, doc["done"]) == (200, True)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "model"),
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": [{"role": "user", "content": ["hi"]}]}, "messages[0].content"),
        ({"model": "m", "messages": [{"content": "hi"}]}, "messages[0].role"),
        ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, "stream"),
        ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "options": [1]}, "options"),
        ({"model": "m", "prompt": 7}, "prompt"),
        ({"model": "m", "prompt": "hi", "system": ["be brief"]}, "system"),
        # nvext's sampling and what the router writes in OpenAI's names: Ollama's body has none
        ({"model": "m", "prompt": "hi", "nvext": {"top_k": 2}}, "nvext.top_k"),
        ({"model": "m", "prompt": "hi", "nvext": {"greed_sampling": True}}, "nvext.greed_sampling"),
        ({"model": "m", "prompt": "hi", "nvext": {"extra_fields": ["worker_id"]}}, "nvext.extra_fields"),
    ],
)
async def test_a_body_the_engine_would_refuse_is_the_clients_400_naming_the_field(
    http: aiohttp.ClientSession, body: dict[str, Any], field: str
) -> None:
    async with mock_fleet(1) as (front, _, _):
        status, doc, _ = await ask(http, front.url, body)
        assert (status, doc["error"]["param"]) == (400, field), doc
        if field.startswith("nvext."):  # (the OpenAI path that takes it: a completion for a prompt)
            assert doc["error"]["message"].endswith("send the request to /v1/completions"), doc


async def test_the_engines_own_refusal_names_the_option_as_the_client_sent_it(
    http: aiohttp.ClientSession,
) -> None:
    async with mock_fleet(1) as (front, _, _):
        body = ollama_chat(CONTRACT, options={"num_predict": -1}, stream=False)
        status, doc, _ = await ask(http, front.url, body)
        assert (status, doc["error"]["param"]) == (400, "options.num_predict"), doc


async def test_inside_the_engines_an_ollama_chat_is_served_by_the_peer_that_caches_it(
    http: aiohttp.ClientSession,
) -> None:
    async with start_mesh(2, RouterConfig(), MockConfig(block_size=BS, speedup=50.0)) as nodes:
        entry, holder = (node.url for node in nodes)
        await warm(http, entry, chat(MockConfig().model, CONTRACT), holder)
        status, lines, headers = await ask(http, entry, ollama_chat(CONTRACT))
        assert status == 200
        assert headers[WORKER] == holder
        assert lines[-1]["done"] is True


async def test_an_ollama_client_lists_and_describes_the_model_through_the_router(
    http: aiohttp.ClientSession,
) -> None:
    """Before it chats, an Ollama client asks ``/api/tags`` and ``/api/show`` of the address it
    was given: the router relays them to a worker (each was a 404)."""
    async with mock_fleet(2) as (front, mocks, _):
        model = mocks[0].config.model
        async with http.get(front.url + "/api/tags") as r:
            assert r.status == 200
            assert [m["name"] for m in (await r.json())["models"]] == [model]
        async with http.post(front.url + "/api/show", json={"model": model}) as r:
            assert r.status == 200
            assert (await r.json())["model_info"]["general.name"] == model
        async with http.post(front.url + "/api/show", json={"name": model}) as r:
            assert (r.status, (await r.json())["error"]["param"]) == (400, "model")


async def test_a_route_moved_by_sglangs_variable_is_routed_there(
    http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang serves Ollama's chat on the path ``SGLANG_OLLAMA_CHAT_ROUTE`` names: the router
    routes it there, as a chat, and no longer takes ``/api/chat`` for one (the engine's 404). The
    model list moved likewise is relayed where it moved."""
    monkeypatch.setenv("SGLANG_OLLAMA_CHAT_ROUTE", "/ollama/api/chat")
    monkeypatch.setenv("SGLANG_OLLAMA_TAGS_ROUTE", "/ollama/api/tags")
    async with mock_fleet(2) as (front, mocks, _):
        model = mocks[0].config.model
        home = mocks[1].base_url
        await warm(http, front.url, chat(model, CONTRACT), home)
        async with http.post(front.url + "/ollama/api/chat", json=ollama_chat(CONTRACT, stream=False)) as r:
            doc = await r.json()
            assert r.status == 200, doc
            assert r.headers[WORKER] == home
            assert doc["done"] is True and doc["prompt_eval_count"] > 4 * BS
        async with http.post(front.url + "/api/chat", json=ollama_chat(CONTRACT, stream=False)) as r:
            assert r.status == 404
        status, doc, _ = await ask(http, front.url, ollama_generate(MANUAL, stream=False))  # (not moved)
        assert status == 200, doc
        async with http.get(front.url + "/ollama/api/tags") as r:  # (relayed where it moved)
            assert r.status == 200
            assert [m["name"] for m in (await r.json())["models"]] == [model]
