"""Anthropic's ``POST /v1/messages`` through a standalone router in front of mock engines, over HTTP.

The mock serves the Messages API as vLLM 0.33.0 does (kvmesh.mock.messages). A Messages request is
routed on the prompt the engine renders it as, the same prompt as the chat request with the same
messages, so the two share cached blocks; the router reads the answer in Anthropic's names (its
first token after ``message_start``, its usage from ``message_delta``) and frees its load.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from kvmesh.router.asgi.accounting import _includes_usage
from kvmesh.router.request.parse import parse_request
from kvmesh.router.request.tokenizer import BuiltinTokenizer
from tests.router.asgi.test_agent_features import BS, mock_fleet, until
from tests.router.asgi.test_responses_api import WORKER, reported_cached, twin_served

SYSTEM = "You are a coding agent. Read before you write; keep diffs small. " * 12
QUESTION = "Where is the prefix cache evicted, and under which lock?"


async def message(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, Any, str | None]:
    """(status, the whole message, or the stream's merged ``message_start`` and last usage, or the
    error; the worker that served it)."""
    async with http.post(url + "/v1/messages", json=body) as r:
        worker = r.headers.get(WORKER)
        if r.status != 200 or not body.get("stream"):
            return r.status, await r.json(), worker
        raw = (await r.read()).decode()
    events = [json.loads(part.split("data: ", 1)[1]) for part in raw.split("\n\n") if "data: " in part]
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
    usage = next(e["usage"] for e in events if e["type"] == "message_delta")
    return 200, {**events[0]["message"], "usage": usage}, worker


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_messages_turn_goes_where_its_chat_twin_is_cached(
    http: aiohttp.ClientSession, stream: bool
) -> None:
    async with mock_fleet(3) as (front, mocks, app):
        model = mocks[0].config.model
        chat = {
            "model": model,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
            "max_tokens": 4,
        }
        home, reported_before = await twin_served(http, front.url, app, "/v1/chat/completions", chat)
        body = {
            "model": model,
            "max_tokens": 5,
            "system": SYSTEM,
            "messages": [{"role": "user", "content": [{"type": "text", "text": QUESTION}]}],
            "stream": stream,
        }
        status, answer, worker = await message(http, front.url, body)
        assert status == 200, answer
        assert worker == home
        cached = answer["usage"]["cache_read_input_tokens"]
        prompt = answer["usage"]["input_tokens"] + cached
        assert cached == (prompt - 1) // BS * BS > 0
        decision = app.mesh.router.recent_decisions(1)[-1][1]
        assert decision.cached_tokens == cached
        await until(lambda: not app.mesh.router.tracking(decision.request_id))
        assert await reported_cached(http, front.url, home) == reported_before + cached


async def test_what_the_messages_api_has_no_field_for_is_refused(http: aiohttp.ClientSession) -> None:
    async with mock_fleet(1) as (front, mocks, _):
        body = {
            "model": mocks[0].config.model,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}],
        }
        for nvext, field in (
            ({"ignore_eos": True}, "nvext.ignore_eos"),
            ({"max_thinking_tokens": 64}, "nvext.max_thinking_tokens"),
            ({"agent_hints": {"speculative_prefill": True}}, "nvext.agent_hints.speculative_prefill"),
            ({"token_data": [1, 2, 3]}, "nvext.token_data"),
        ):
            status, error, _ = await message(http, front.url, {**body, "nvext": nvext})
            assert status == 400, error
            assert error["error"]["param"] == field, error
        streamed = {**body, "stream": True, "nvext": {"extra_fields": ["worker_id"]}}
        status, error, _ = await message(http, front.url, streamed)
        assert (status, error["error"]["param"]) == (400, "nvext.extra_fields")
        # top_k is Anthropic's own: taken; and the echo of a whole answer is merged into it
        ok = {**body, "nvext": {"top_k": 5, "extra_fields": ["worker_id"]}}
        status, answer, worker = await message(http, front.url, ok)
        assert status == 200, answer
        assert answer["type"] == "message" and answer["nvext"]["worker_id"]["decode_worker_id"] == worker


@pytest.mark.parametrize(
    ("endpoint", "body"),
    [
        ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}),
        ("/generate", {"text": "x"}),
        ("/v1/responses", {"input": "x"}),
    ],
)
def test_a_stream_that_always_carries_its_counts_is_counted_an_event_a_token(
    endpoint: str, body: Any
) -> None:
    """(Not by tokenizing each event's text, which the tap reads only in chat's and completions'
    shapes: before, a Messages or /generate stream's output went uncounted until it ended.)"""
    parsed = parse_request(
        json.dumps({**body, "stream": True}).encode(), [], endpoint,
        tokenizer=BuiltinTokenizer(), block_size=BS, lora_of=lambda _: None, clock=lambda: 0.0,
    )  # fmt: skip
    assert _includes_usage(parsed)
