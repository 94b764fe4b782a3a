"""A prompt the engine computes whole is routed without credit for a cached prefix (over HTTP).

vLLM reads none of its prefix cache for a request with prompt logprobs: ``prompt_logprobs``, or
``echo`` with logprobs on (a chat's ``top_logprobs`` is 0 unless sent as null, so every chat
``echo``; a completion's ``logprobs``). Crediting the worker that holds the prefix would price a
prefill that does not happen: the request goes where its whole prefill is cheapest.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from kvmesh.router.request.parse import prompt_recomputed
from tests.router.asgi.test_agent_features import mock_fleet
from tests.router.fleet import chat, fleet, indexed

PROMPT = " ".join(f"word{i}" for i in range(300))


@pytest.mark.parametrize(
    ("body", "endpoint", "whole"),
    [
        ({"prompt_logprobs": 1}, "/v1/chat/completions", True),
        ({"prompt_logprobs": 0}, "/v1/completions", True),
        ({"echo": True}, "/v1/chat/completions", True),
        ({"echo": True, "top_logprobs": None}, "/v1/chat/completions", False),
        ({"echo": True, "logprobs": 2}, "/v1/completions", True),
        ({"echo": True}, "/v1/completions", False),
        ({"logprobs": 2}, "/v1/completions", False),
        ({"prompt_logprobs": None}, "/v1/chat/completions", False),
        ({}, "/v1/chat/completions", False),
    ],
)
def test_which_prompts_vllm_computes_whole(body: dict[str, Any], endpoint: str, whole: bool) -> None:
    assert prompt_recomputed(body, endpoint) is whole


async def test_a_request_with_prompt_logprobs_gets_no_credit_for_the_cached_prefix(
    http: aiohttp.ClientSession,
) -> None:
    async with fleet(2) as (front, states, engines):
        extra = ["timing", "worker_id"]

        async def send(**fields: Any) -> dict[str, Any]:
            nvext = {"extra_fields": extra, **fields.pop("nvext", {})}
            async with http.post(
                front.url + "/v1/chat/completions", json=chat(PROMPT, nvext=nvext, **fields)
            ) as r:
                assert r.status == 200, await r.text()
                return (await r.json())["nvext"]  # type: ignore[no-any-return]

        home = engines[0].url
        await send(nvext={"backend_instance_id": home})
        again = await send()
        assert again["worker_id"]["decode_worker_id"] == home
        assert again["timing"]["cached_tokens_predicted"] > 0
        for fields in ({"prompt_logprobs": 1}, {"echo": True}):
            whole = await send(**fields)
            assert whole["timing"]["cached_tokens_predicted"] == 0, fields
        # the field reaches the engine as sent
        assert [b["prompt_logprobs"] for s in states for b in s.received if "prompt_logprobs" in b] == [1]


async def test_the_routers_prediction_matches_the_engine_for_a_chat_echo(http: aiohttp.ClientSession) -> None:
    """Over mock engines, which read no cache for a chat ``echo`` as vLLM does: the router predicts
    what the engine reports (0 cached tokens), where it had predicted the cached prefix."""
    async with mock_fleet(1) as (front, mocks, _):
        body = chat(PROMPT, model=mocks[0].config.model, max_tokens=2, nvext={"extra_fields": ["timing"]})

        async def cached(**extra: Any) -> tuple[int, int]:
            async with http.post(front.url + "/v1/chat/completions", json={**body, **extra}) as r:
                assert r.status == 200, await r.text()
                doc = await r.json()
            return doc["nvext"]["timing"]["cached_tokens_predicted"], doc["usage"]["prompt_tokens_details"][
                "cached_tokens"
            ]

        await cached()
        await indexed(http, front.url, mocks[0].base_url, 1)
        predicted, reported = await cached()
        assert predicted > 0 and reported > 0
        assert await cached(echo=True) == (0, 0)
