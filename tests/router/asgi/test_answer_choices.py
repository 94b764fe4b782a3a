"""What the router reads of an answer of ``n`` choices, or one that echoes its prompt (``echo``).

A standalone router in front of mock engines, over HTTP. The mock streams ``n`` choices as vLLM
does (one choice an event, interleaved) and echoes as vLLM does (a completion's prompt before each
choice's first text; a chat's last message, when the answer continues it, in an event of its own).
What follows a turn (the ``cache_control`` pin of prompt + answer, the ``speculative_prefill``
warm-up of the next turn) must be of the first choice alone, without the echo; a stream without
``usage`` is counted in the tokens each choice generated, the echo left out. An answer that
calls tools (a test engine streams the calls in OpenAI's pieces) is warmed with its calls.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from kvmesh.router.core.config import RouterConfig
from kvmesh.router.mesh.metrics import get_metrics
from kvmesh.router.request.tokenizer import BuiltinTokenizer
from tests.router.asgi.test_agent_features import BS, mock_fleet, until
from tests.router.fleet import chat, fleet
from tests.router.servers import wait_until

PIN = {"cache_control": {"type": "ephemeral", "ttl": "5m"}}
TOK = BuiltinTokenizer()


async def answer(http: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The answer, whole or streamed; a stream is put back together choice by choice."""
    async with http.post(url + path, json=body) as r:
        assert r.status == 200, await r.text()
        if not body.get("stream"):
            return await r.json()  # type: ignore[no-any-return]
        raw = await r.read()
    texts: dict[int, str] = {}
    for event in raw.decode().split("\n\n"):
        payload = event.removeprefix("data: ")
        if not payload or payload == "[DONE]":
            continue
        for choice in json.loads(payload).get("choices", []):
            part = choice.get("delta", {}).get("content") if "delta" in choice else choice.get("text")
            texts[choice["index"]] = texts.get(choice["index"], "") + (part or "")
    return {"choices": [{"index": i, "text": texts[i]} for i in sorted(texts)]}


async def assert_next_turn_finds_warmed(
    http: aiohttp.ClientSession, url: str, app: Any, model: str, history: list[dict[str, Any]]
) -> None:
    """Once the warm-up is over, the next turn after ``history`` finds all of it cached, the
    history's last block included, which the test chose to be one only a warm-up computes."""
    through = len(TOK.apply_chat_template(history, add_generation_prompt=False))
    assert through % BS == 0
    await until(lambda: not app.mesh._warmups)
    await asyncio.sleep(0.1)
    follow = {"model": model, "messages": [*history, {"role": "user", "content": "next"}], "max_tokens": 1}
    async with http.post(url + "/v1/chat/completions", json=follow) as r:
        assert r.status == 200
        assert (await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"] >= through


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
async def test_a_pin_after_an_answer_of_several_choices_holds_the_first(
    http: aiohttp.ClientSession, stream: bool
) -> None:
    async with mock_fleet(router=RouterConfig(enable_cache_control=True)) as (front, mocks, _):
        mock = mocks[0]
        messages = [{"role": "user", "content": "three answers to one question, please " * 5}]
        body = {
            "model": mock.config.model,
            "messages": messages,
            "max_tokens": 48,
            "ignore_eos": True,
            "n": 3,
            "stream": stream,
            "nvext": PIN,
        }
        doc = await answer(http, front.url, "/v1/chat/completions", body)
        assert len(doc["choices"]) == 3
        # every full block of prompt + the first choice's answer (its last token never fed back);
        # the choices' text taken together matches none of them past the prompt
        want = (len(TOK.apply_chat_template(messages)) + 48 - 1) // BS
        await until(lambda: mock.engine.retention.num_retained >= want)
        await asyncio.sleep(0.1)
        assert mock.engine.retention.num_retained == want


async def test_a_pin_after_an_echoed_completion_holds_prompt_and_answer_once(
    http: aiohttp.ClientSession,
) -> None:
    async with mock_fleet(router=RouterConfig(enable_cache_control=True)) as (front, mocks, _):
        mock = mocks[0]
        prompt = "an echoed prompt comes back before its answer " * 4
        body = {
            "model": mock.config.model,
            "prompt": prompt,
            "max_tokens": 48,
            "ignore_eos": True,
            "echo": True,
            "stream": True,
            "nvext": PIN,
        }
        doc = await answer(http, front.url, "/v1/completions", body)
        assert doc["choices"][0]["text"].startswith(prompt)
        want = (len(TOK.encode(prompt)) + 48 - 1) // BS
        await until(lambda: mock.engine.retention.num_retained >= want)
        await asyncio.sleep(0.1)
        assert mock.engine.retention.num_retained == want


@pytest.mark.parametrize(
    "extra", [{"n": 2, "stream": True}, {"n": 2}], ids=["two-streamed-choices", "two-whole-choices"]
)
async def test_speculative_prefill_warms_the_next_turn_through_the_first_choice(
    http: aiohttp.ClientSession, extra: dict[str, Any]
) -> None:
    async with mock_fleet() as (front, mocks, app):
        mock = mocks[0]
        # a turn (prompt + answer + end-of-turn marks) that fills its last block exactly: only a
        # warm-up computes that block, the turn alone never does
        for pad in range(BS):
            messages = [{"role": "user", "content": "speculate twice about this " * 8 + "x " * pad}]
            if (len(TOK.apply_chat_template(messages)) + 20) % BS == BS - 2:
                break
        body = {
            "model": mock.config.model,
            "messages": messages,
            "max_tokens": 20,
            "ignore_eos": True,
            "nvext": {"agent_hints": {"speculative_prefill": True}},
            **extra,
        }
        doc = await answer(http, front.url, "/v1/chat/completions", body)
        first = doc["choices"][0]
        text = first["text"] if "text" in first else first["message"]["content"]
        history = [*messages, {"role": "assistant", "content": text}]
        await assert_next_turn_finds_warmed(http, front.url, app, mock.config.model, history)


async def test_a_stream_without_usage_counts_each_choices_output_and_not_the_echo(
    http: aiohttp.ClientSession,
) -> None:
    osl = get_metrics().osl
    async with mock_fleet() as (front, mocks, _):
        mock = mocks[0]
        base = {"model": mock.config.model, "max_tokens": 24, "ignore_eos": True, "stream": True}

        async def counted(path: str, **body: Any) -> float:
            before = osl._sum.get()
            await answer(http, front.url, path, {**base, **body})
            return osl._sum.get() - before  # type: ignore[no-any-return]

        prompt = "count what this echo generates, not what it repeats " * 4
        plain = await counted("/v1/completions", prompt=prompt)
        assert plain > 0
        assert await counted("/v1/completions", prompt=prompt, echo=True) == plain
        assert await counted("/v1/completions", prompt=prompt, n=2) == pytest.approx(2 * plain, abs=2)
        # a chat's echo: the last message the answer continues
        opening = [{"role": "user", "content": "go on"}, {"role": "assistant", "content": "It began " * 20}]
        chat = {"messages": opening, "add_generation_prompt": False}
        assert await counted("/v1/chat/completions", **chat, echo=True) == await counted(
            "/v1/chat/completions", **chat
        )


CALLS = [
    {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
    {"name": "get_time", "arguments": '{"zone": "Europe/Paris"}'},
]
TOOLS = [
    {"type": "function", "function": {"name": c["name"], "parameters": {"type": "object"}}} for c in CALLS
]


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
async def test_speculative_prefill_warms_a_tool_call_answer_as_the_client_sends_it_back(
    http: aiohttp.ClientSession, stream: bool
) -> None:
    """An agent's turn that only calls tools has no text. The warm-up still runs, with the calls
    in the assistant message where the next turn will carry them (before: no warm-up at all)."""
    async with fleet(1, engine_kwargs={"tool_calls": CALLS}) as (front, states, _):
        hints = {"agent_hints": {"speculative_prefill": True}}
        body = chat("weather and time in Paris?", tools=TOOLS, stream=stream, nvext=hints)
        async with http.post(front.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
            await r.read()
        # the message a client sends back: the calls as the engine made them, no text
        calls = [
            {
                "id": f"call_{i}",
                "type": "function",
                "function": {"name": c["name"], "arguments": c["arguments"]},
            }
            for i, c in enumerate(CALLS)
        ]
        sent_back = {"role": "assistant", "content": None, "tool_calls": calls}
        await wait_until(lambda: len(states[0].received) == 2)
        warm = states[0].received[1]
        assert warm["max_tokens"] == 1 and "stream" not in warm and warm["tools"] == TOOLS
        assert warm["messages"] == [*body["messages"], sent_back]


async def test_a_pin_after_a_tool_call_answer_holds_its_prompt(http: aiohttp.ClientSession) -> None:
    """The calls' tokens are the engine's own spelling, which the router can only tell from the
    engine's token ids: without them the pin holds the prompt (before: nothing was pinned)."""
    router = RouterConfig(use_kv_events=False, enable_cache_control=True)
    async with fleet(1, router=router, engine_kwargs={"tool_calls": CALLS}) as (front, states, _):
        body = chat("weather and time in Paris?", tools=TOOLS, stream=True, nvext=PIN)
        async with http.post(front.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
            await r.read()
        await wait_until(lambda: any(name == "pin_prefix" for name, _ in states[0].rpcs))
        pin = next(args for name, args in states[0].rpcs if name == "pin_prefix")
        assert pin["token_ids"] == TOK.apply_chat_template(body["messages"], tools=TOOLS)


async def test_speculative_prefill_after_a_continued_message_warms_the_history_closed(
    http: aiohttp.ClientSession,
) -> None:
    """An answer that continues the client's own start of it (``continue_final_message``): the
    next turn carries one assistant message, the start and the answer, closed. The warm-up
    renders that, not the start as a message of its own followed by the answer left open."""
    async with mock_fleet() as (front, mocks, app):
        mock = mocks[0]
        question = {"role": "user", "content": "plan my week, day by day " * 6}
        for pad in range(BS):  # the closed history fills its last block: only a warm-up makes it
            start = {"role": "assistant", "content": "Monday: " * 4 + "x " * pad}
            opened = TOK.apply_chat_template([question, start], continue_final_message=True)
            if (len(opened) + 20 + 2) % BS == 0:
                break
        body = {
            "model": mock.config.model,
            "messages": [question, start],
            "add_generation_prompt": False,
            "continue_final_message": True,
            "max_tokens": 20,
            "ignore_eos": True,
            "nvext": {"agent_hints": {"speculative_prefill": True}},
        }
        doc = await answer(http, front.url, "/v1/chat/completions", body)
        assert doc["usage"]["prompt_tokens"] == len(opened)  # the mock left it open as well
        history = [
            question,
            {"role": "assistant", "content": start["content"] + doc["choices"][0]["message"]["content"]},
        ]
        await assert_next_turn_finds_warmed(http, front.url, app, mock.config.model, history)
