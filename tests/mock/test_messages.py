"""The mock's Anthropic Messages API (``POST /v1/messages``), driven over HTTP on loopback.

The mock serves it as vLLM 0.33.0 does: the body generated as the chat request it renders as, the
answer a ``message`` with one text block and ``usage`` in Anthropic's names (``input_tokens``
without the cached ones, which are ``cache_read_input_tokens``: the engine's real prefix-cache
hit); a stream of ``event:``/``data:`` pairs from ``message_start`` to ``message_stop``, no
``[DONE]``. Errors keep the mock's shape, the field in ``param``.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from kvmesh.mock.testing import run_mock
from kvmesh.router.request.messages_api import chat_view
from kvmesh.router.request.tokenizer import BuiltinTokenizer
from tests.mock.test_server import metric, wait_idle

pytestmark = pytest.mark.e2e

MODEL = "kvmesh-mock"
SYSTEM = "You are a helpful assistant who answers briefly. " * 12
BS = 16
BODY: dict[str, Any] = {
    "model": MODEL,
    "max_tokens": 6,
    "system": [{"type": "text", "text": SYSTEM}],
    "messages": [{"role": "user", "content": [{"type": "text", "text": "Say hello."}]}],
}
TOOLS = [
    {
        "name": "get_weather",
        "description": "The weather in a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]


def _events(raw: str) -> list[tuple[str, dict[str, Any]]]:
    """The stream's ``(event, data)`` pairs; each event's name is its data's ``type``."""
    parts = raw.split("\n\n")
    assert parts[-1] == ""
    out = []
    for part in parts[:-1]:
        name, data = part.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), part
        doc = json.loads(data.removeprefix("data: "))
        assert doc["type"] == name.removeprefix("event: ")
        out.append((doc["type"], doc))
    return out


def _prompt_len(body: dict[str, Any]) -> int:
    view = chat_view(body)
    return len(BuiltinTokenizer().apply_chat_template(view["messages"], tools=view.get("tools")))


async def test_a_whole_answer_and_a_stream_as_vllm_serves_them() -> None:
    async with (
        run_mock(block_size=BS, num_blocks=256, speedup=20) as mock,
        httpx.AsyncClient(base_url=mock.base_url) as http,
    ):
        prompt_len = len(
            BuiltinTokenizer().apply_chat_template(
                [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Say hello."}]
            )
        )
        assert _prompt_len(BODY) == prompt_len  # rendered as the chat request it stands for

        r = await http.post("/v1/messages", json=BODY, headers={"x-request-id": "req-1"})
        assert r.status_code == 200, r.text
        first = r.json()
        assert first["id"] == "chatcmpl-req-1" == r.headers["x-request-id"]  # (vLLM's: the chat id)
        text = first["content"][0]["text"]
        assert text and first["content"] == [{"type": "text", "text": text}]
        assert {k: first[k] for k in ("type", "role", "model", "stop_reason")} == {
            "type": "message",
            "role": "assistant",
            "model": MODEL,
            "stop_reason": "max_tokens",
        }
        assert "stop_sequence" not in first  # (vLLM leaves out its null fields)
        assert first["usage"] == {
            "input_tokens": prompt_len,
            "output_tokens": 6,
            "cache_read_input_tokens": 0,
        }

        # The same request again: the prompt's whole blocks are read from the cache.
        cached = (prompt_len - 1) // BS * BS
        again = (await http.post("/v1/messages", json=BODY)).json()
        assert again["content"] == first["content"]  # (the same seed, the same prompt)
        assert again["usage"] == {
            "input_tokens": prompt_len - cached,
            "output_tokens": 6,
            "cache_read_input_tokens": cached,
        }
        assert cached > 0 and again["id"].startswith("chatcmpl-") and again["id"] != first["id"]

        # Its chat twin is the same request: the same prompt, cache hit and answer.
        view = chat_view(BODY)
        chat = (await http.post("/v1/chat/completions", json={**view, "max_tokens": 6})).json()
        assert chat["usage"]["prompt_tokens"] == prompt_len
        assert chat["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
        assert chat["choices"][0]["message"]["content"] == text

        async with http.stream("POST", "/v1/messages", json={**BODY, "stream": True}) as s:
            assert s.status_code == 200
            assert s.headers["content-type"].startswith("text/event-stream")
            assert s.headers["x-request-id"].startswith("chatcmpl-")
            events = _events((await s.aread()).decode())
    kinds = [kind for kind, _ in events]
    deltas = kinds.count("content_block_delta")
    assert deltas >= 2  # (one event a step at least)
    assert kinds == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * deltas,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    docs = [doc for _, doc in events]
    start = docs[0]["message"]
    assert start == {
        "id": start["id"],
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": MODEL,
        "stop_reason": None,
        "stop_sequence": None,
        # (vLLM's first chat chunk: the whole prompt, no cache details yet)
        "usage": {"input_tokens": prompt_len, "output_tokens": 0},
    }
    assert start["id"].startswith("chatcmpl-")
    assert docs[1] == {
        "type": "content_block_start",
        "content_block": {"type": "text", "text": ""},
        "index": 0,
    }
    pieces = []
    for doc in docs[2 : 2 + deltas]:
        assert doc["index"] == 0 and doc["delta"]["type"] == "text_delta"
        pieces.append(doc["delta"]["text"])
    assert "".join(pieces) == text  # the whole answer's, the same seed
    assert docs[-3] == {"type": "content_block_stop", "index": 0}
    assert docs[-2] == {
        "type": "message_delta",
        "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
        "usage": {"input_tokens": prompt_len - cached, "output_tokens": 6, "cache_read_input_tokens": cached},
    }
    assert docs[-1] == {"type": "message_stop"}


async def test_a_tool_use_and_its_result_are_rendered_as_the_chat_twin() -> None:
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 3,
        "tools": TOOLS,
        "tool_choice": {"type": "auto"},
        "messages": [
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "Sunny"}],
                    },
                    {"type": "text", "text": "Thanks. And tomorrow?"},
                ],
            },
        ],
    }
    async with (
        run_mock(block_size=BS, num_blocks=256, speedup=200) as mock,
        httpx.AsyncClient(base_url=mock.base_url) as http,
    ):
        r = await http.post("/v1/messages", json=body)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        prompt_len = _prompt_len(body)
        assert usage["input_tokens"] + usage["cache_read_input_tokens"] == prompt_len
        assert usage["output_tokens"] == 3
        # The tools and the tool turns are in the prompt: without them it is shorter.
        bare = {**body, "messages": body["messages"][:1]}
        del bare["tools"], bare["tool_choice"]
        assert _prompt_len(bare) < prompt_len
        chat = (await http.post("/v1/chat/completions", json={**chat_view(body), "max_tokens": 3})).json()
        assert chat["usage"]["prompt_tokens"] == prompt_len
        assert chat["choices"][0]["message"]["content"] == r.json()["content"][0]["text"]

        # What changes nothing in the mock is taken: a thinking budget, a forced tool, metadata.
        taken = {
            **body,
            "max_tokens": 1100,
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
            "metadata": {"user_id": "u-1"},
            "stop_sequences": ["\n\nHuman:"],
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 40,
            "output_config": {"effort": "low"},
        }
        r = await http.post("/v1/messages", json=taken)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["output_tokens"] == 1100


@pytest.mark.parametrize(
    ("change", "field", "status"),
    [
        pytest.param({"max_tokens": None}, "max_tokens", 400, id="no-max-tokens"),
        pytest.param({"max_tokens": 0}, "max_tokens", 400, id="max-tokens-0"),
        pytest.param({"max_tokens": 10**9}, "max_tokens", 400, id="max-tokens-past-context"),
        pytest.param({"messages": "hello"}, "messages", 400, id="messages-not-a-list"),
        pytest.param(
            {"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role", 400, id="bad-role"
        ),
        pytest.param(
            {"messages": [{"role": "user", "content": [{"type": "video"}]}]},
            "messages[0].content[0].type",
            400,
            id="bad-block",
        ),
        pytest.param({"model": None}, "model", 400, id="no-model"),
        pytest.param({"model": "other"}, "model", 404, id="unknown-model"),
        pytest.param({"stop_sequences": "x"}, "stop_sequences", 400, id="stop-not-a-list"),
        pytest.param(
            {"stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences", 400, id="stop-too-many"
        ),
        pytest.param({"temperature": 5}, "temperature", 400, id="temperature"),
        pytest.param({"top_k": -5}, "top_k", 400, id="top-k"),
        pytest.param({"stream": "yes"}, "stream", 400, id="stream"),
        pytest.param({"thinking": {"type": "sometimes"}}, "thinking.type", 400, id="thinking-type"),
        pytest.param(
            {"thinking": {"type": "enabled", "budget_tokens": 10}},
            "thinking.budget_tokens",
            400,
            id="budget-small",
        ),
        pytest.param(
            {"thinking": {"type": "enabled", "budget_tokens": 2048}},
            "thinking.budget_tokens",
            400,
            id="budget-past-max-tokens",
        ),
        pytest.param({"tool_choice": {"type": "tool"}}, "tool_choice.name", 400, id="tool-choice-no-name"),
        pytest.param({"tool_choice": {"type": "required"}}, "tool_choice.type", 400, id="tool-choice-type"),
        pytest.param({"output_config": {"effort": "extreme"}}, "output_config.effort", 400, id="effort"),
        # What the mock cannot honour:
        pytest.param({"cache_salt": "s"}, "cache_salt", 400, id="cache-salt"),
        pytest.param(
            {"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
            "output_config.format",
            400,
            id="structured-output",
        ),
        pytest.param(
            {"kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params", 400, id="hand-off"
        ),
        pytest.param({"watermarking": True}, "watermarking", 400, id="watermark"),
        pytest.param(
            {
                "messages": [
                    {
                        "role": "system",
                        "content": [
                            {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "x"}}
                        ],
                    },
                    {"role": "user", "content": "hi"},
                ]
            },
            "messages[0].content[0].tool",  # (a tool 'tools' does not declare, as vLLM refuses it)
            400,
            id="tool-change",
        ),
        pytest.param(
            {
                "tools": [{"name": "x", "input_schema": {"type": "object"}}],
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "x"}}
                        ],
                    },
                ],
            },
            "messages[0].content[0].type",  # (vLLM takes tool changes in system messages only)
            400,
            id="tool-change-outside-system",
        ),
    ],
)
async def test_a_body_the_engine_cannot_serve_is_refused_naming_the_field(
    change: dict[str, Any], field: str, status: int
) -> None:
    body = {**BODY, "max_tokens": 1100, **change}
    body = {k: v for k, v in body.items() if v is not None}
    async with run_mock(speedup=20) as mock, httpx.AsyncClient(base_url=mock.base_url) as http:
        r = await http.post("/v1/messages", json=body)
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert error["param"] == field and error["message"]  # (the mock's shape, not Anthropic's)
        for bad in (b"{not json", b"[1]"):
            r = await http.post("/v1/messages", content=bad)
            assert r.status_code == 400 and r.json()["error"]["param"] == "body"


async def test_a_client_disconnect_aborts_the_request() -> None:
    async with (
        run_mock(block_size=BS, num_blocks=128, speedup=5) as mock,
        httpx.AsyncClient(base_url=mock.base_url) as http,
    ):
        engine = mock.engine
        body = {
            **BODY,
            "max_tokens": 1500,
            "messages": [{"role": "user", "content": "tell me a story " * 20}],
        }
        async with http.stream("POST", "/v1/messages", json={**body, "stream": True}) as r:
            assert (await anext(r.aiter_lines())) == "event: message_start"
            assert engine.scheduler.num_running == 1
        await wait_idle(engine)
        assert engine.pool.num_used == 0

        with pytest.raises(httpx.ReadTimeout):
            await http.post("/v1/messages", json=body, timeout=0.3)
        await wait_idle(engine)
        assert engine.pool.num_used == 0
        metrics = (await http.get("/metrics")).text
        assert metric(metrics, 'vllm:request_success_total{finished_reason="abort",') == 2
