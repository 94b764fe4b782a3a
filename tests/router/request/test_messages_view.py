"""An Anthropic Messages body as the chat request an engine renders
(kvmesh/router/request/messages_api.py), with no engine installed.

The conversion itself is held to vLLM 0.33.0's own in the engine tier
(tests/engines/test_vllm_messages.py), and SGLang's inside SGLang's app."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvmesh.errors import RequestError
from kvmesh.router.request.messages_api import chat_view, messages_usage
from kvmesh.router.request.parse import parse_request
from kvmesh.router.request.tokenizer import BuiltinTokenizer

TOK = BuiltinTokenizer()
SYSTEM = "You are a coding agent working in a large repository. " * 10


def parsed(body: dict[str, Any], endpoint: str) -> Any:
    return parse_request(
        json.dumps(body).encode(), [], endpoint, tokenizer=TOK, block_size=16, lora_of=lambda _: None,
        clock=lambda: 0.0,
    )  # fmt: skip


def test_a_messages_body_hashes_to_the_blocks_of_its_chat_twin() -> None:
    chat = parsed(
        {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Fix the bug."}]},
        "/v1/chat/completions",
    )
    anthropic = parsed(
        {
            "model": "m",
            "max_tokens": 64,
            "system": [
                {"type": "text", "text": "x-anthropic-billing-header: cch=1f2e"},
                {"type": "text", "text": SYSTEM},
            ],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Fix the bug."}]}],
        },
        "/v1/messages",
    )
    assert anthropic.tokens == chat.tokens and anthropic.hashes == chat.hashes  # (billing header dropped)


def test_tool_calls_and_results_become_chat_tool_messages() -> None:
    view = chat_view(
        {
            "max_tokens": 8,
            "messages": [
                {"role": "user", "content": "list files"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t1", "name": "ls", "input": {"d": "."}}],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t1",
                            "content": [{"type": "text", "text": "a.py"}],
                        }
                    ],
                },
            ],
        }
    )
    assert view["messages"] == [
        {"role": "user", "content": "list files"},
        {"role": "assistant", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "ls", "arguments": '{"d": "."}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "a.py"},
    ]  # fmt: skip


def test_a_tool_results_images_and_tool_references_become_messages_of_their_own() -> None:
    """As vLLM 0.33.0 converts them: a screenshot in a tool result is a user message after the
    tool's text (it was dropped, and the router hashed a prompt the engine never rendered)."""
    result = {
        "type": "tool_result",
        "tool_use_id": "t1",
        "content": [
            {"type": "text", "text": "took it"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
            {"type": "image", "source": {"type": "url", "url": "https://example.invalid/s.png"}},
            {"type": "tool_reference", "tool_name": "screenshot"},
            {"type": "text", "text": "done"},
        ],
    }
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [result]}]}
    assert chat_view(body)["messages"] == [
        {"role": "tool", "tool_call_id": "t1", "content": "took it\ndone"},
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            {"type": "image_url", "image_url": {"url": "https://example.invalid/s.png"}},
        ]},
        {"role": "tool", "tool_call_id": "t1", "content": [{"type": "tool_reference", "name": "screenshot"}]},
    ]  # fmt: skip
    assert parsed(body, "/v1/messages").cache_keyed == "multimodal content"


def test_tool_additions_and_removals_change_the_tools_the_template_sees() -> None:
    tools = [
        {"name": "read", "input_schema": {"type": "object"}},
        {"name": "deploy", "input_schema": {"type": "object"}, "defer_loading": True},
    ]

    def change(kind: str, tool: dict[str, Any]) -> dict[str, Any]:
        return {"type": kind, "tool": tool}

    lint = {"name": "lint", "input_schema": {"type": "object"}}
    blocks = [
        change("tool_addition", {"type": "tool_reference", "name": "deploy"}),
        change("tool_removal", {"type": "tool_reference", "name": "read"}),
        change("tool_addition", {"type": "tool_definition", "definition": lint}),
        {"type": "text", "text": "go"},
    ]
    body = {"model": "m", "max_tokens": 8, "tools": tools, "messages": [{"role": "user", "content": blocks}]}
    names = [(t["function"]["name"], t["function"].get("defer_loading")) for t in chat_view(body)["tools"]]
    assert names == [("deploy", None), ("lint", None)]  # (added by name: no longer deferred)
    for bad in (
        change("tool_removal", {"type": "tool_reference", "name": "nope"}),
        change("tool_removal", {"type": "tool_definition", "definition": lint}),
        change("tool_addition", None),  # type: ignore[arg-type]
    ):
        wrong = {**body, "messages": [{"role": "user", "content": [bad]}]}
        with pytest.raises(RequestError) as e:
            chat_view(wrong)
        assert e.value.field == "messages[0].content[0].tool"
    # a bad tool is named where it is, with changes as without them
    no_schema = change("tool_addition", {"type": "tool_definition", "definition": {"name": "x"}})
    for tools_sent, block, field in (
        (tools, no_schema, "messages[0].content[0].tool.definition.input_schema"),
        ([*tools, {"name": 3}], blocks[0], "tools[2]"),
    ):
        wrong = {**body, "tools": tools_sent, "messages": [{"role": "user", "content": [block]}]}
        with pytest.raises(RequestError) as e:
            chat_view(wrong)
        assert e.value.field == field


def test_an_image_or_turned_off_thinking_keys_the_prompt_apart() -> None:
    base = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": SYSTEM}]}
    assert parsed(base, "/v1/messages").cache_keyed is None
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    with_image = {
        **base,
        "messages": [{"role": "user", "content": [image, {"type": "text", "text": SYSTEM}]}],
    }
    assert parsed(with_image, "/v1/messages").cache_keyed == "multimodal content"
    no_thinking = {**base, "thinking": {"type": "disabled"}}
    assert parsed(no_thinking, "/v1/messages").cache_keyed == "chat_template_kwargs"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ({"max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ({"max_tokens": 8, "messages": []}, "messages"),
        ({"max_tokens": 8, "messages": "hi"}, "messages"),
        ({"max_tokens": 8, "messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
        ({"max_tokens": 8, "messages": [{"role": "user", "content": 7}]}, "messages[0].content"),
        ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"text": "x"}]}]}, "messages[0].content[0]"),
        ({"max_tokens": 8, "system": 5, "messages": [{"role": "user", "content": "x"}]}, "system"),
        ({"max_tokens": 8, "messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f"}]},
         "tools[0].input_schema"),
    ],
)  # fmt: skip
def test_what_no_engine_takes_is_a_400_naming_the_field(body: dict[str, Any], field: str) -> None:
    with pytest.raises(RequestError) as e:
        chat_view(body)
    assert e.value.status == 400 and e.value.field == field


def test_anthropic_usage_counts_the_cached_tokens_into_the_prompt() -> None:
    usage = {
        "input_tokens": 9,
        "cache_read_input_tokens": 32,
        "cache_creation_input_tokens": 0,
        "output_tokens": 4,
    }
    assert messages_usage(usage) == {
        "prompt_tokens": 41,
        "completion_tokens": 4,
        "prompt_tokens_details": {"cached_tokens": 32},
    }
