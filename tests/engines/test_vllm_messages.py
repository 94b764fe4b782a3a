"""An Anthropic Messages body read as vLLM 0.33.0 reads it (engine tier).

vLLM serves ``POST /v1/messages`` by converting the body into a chat request
(``AnthropicServingMessages.to_chat_completion_request``) and rendering that. Inside vLLM, kvmesh's
tokenizer calls that very conversion (``VllmTokenizer.messages_as_chat``), with what vLLM worked
out from the chat template at start-up (whether inline system messages are merged). Outside vLLM
(the standalone router, the mock) the router converts on its own
(``kvmesh.router.request.messages_api.chat_view``); both must give vLLM's messages and tools, or
the router hashes other ids than the engine caches.

This machine has no model, so vLLM's renderer cannot render here: the recorder of
tests/engines/test_vllm_tokenizer.py stands in for it and keeps what kvmesh gives it.
"""

from __future__ import annotations

import json
import warnings
from typing import Any

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # torch's, at import
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

from kvmesh.errors import RequestError
from kvmesh.router.request.messages_api import chat_view
from kvmesh.router.request.parse import parse_request
from kvmesh.router.request.tokenizer import prompt_token_ids
from tests.engines.test_vllm_tokenizer import bound

pytestmark = pytest.mark.engine_vllm

TOOLS = [
    {"name": "read_file", "description": "Read a file", "input_schema": {"type": "object"}},
    {"name": "grep", "input_schema": {"properties": {"pattern": {"type": "string"}}}, "strict": True},
]
BODIES: dict[str, dict[str, Any]] = {
    "text": {"messages": [{"role": "user", "content": "What is a KV cache?"}]},
    "system-blocks": {
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=9f3a"},
            {"type": "text", "text": "You are Claude Code. "},
            {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    },
    "agent-turn": {
        "system": "You are a coding agent.",
        "tools": TOOLS,
        "messages": [
            {"role": "user", "content": "Find the cache code."},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "grep first", "signature": "s"},
                    {"type": "text", "text": "Searching."},
                    {"type": "tool_use", "id": "toolu_1", "name": "grep", "input": {"pattern": "cache"}},
                    {"type": "tool_use", "id": "toolu_2", "name": "read_file", "input": {}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.py:3"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_2",
                        "content": [{"type": "text", "text": "line 1"}, {"type": "text", "text": "line 2"}],
                    },
                    {"type": "text", "text": "Now explain it."},
                ],
            },
        ],
    },
    "inline-system": {
        "system": "Top.",
        "messages": [
            {"role": "user", "content": "one"},
            {"role": "system", "content": "<reminder>stay on task</reminder>"},
            {"role": "user", "content": "two"},
        ],
    },
    "tool-result-media": {
        "messages": [
            {"role": "user", "content": "Take a screenshot."},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "toolu_3", "name": "screenshot", "input": {}}],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_3",
                        "content": [
                            {"type": "text", "text": "captured"},
                            {
                                "type": "image",
                                "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"},
                            },
                            {
                                "type": "image",
                                "source": {"type": "url", "url": "https://example.invalid/s.png"},
                            },
                            {"type": "tool_reference", "tool_name": "grep"},
                        ],
                    },
                    {"type": "text", "text": "What does it show?"},
                ],
            },
        ],
    },
    "tool-changes": {
        "tools": [*TOOLS, {"name": "deploy", "input_schema": {"type": "object"}, "defer_loading": True}],
        "messages": [
            {
                "role": "system",  # (vLLM takes tool changes there only)
                "content": [
                    {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "deploy"}},
                    {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "read_file"}},
                    {
                        "type": "tool_addition",
                        "tool": {
                            "type": "tool_definition",
                            "definition": {
                                "name": "lint",
                                "description": "Lint",
                                "input_schema": {"type": "object"},
                            },
                        },
                    },
                    {"type": "text", "text": "Tools changed."},
                ],
            },
            {"role": "user", "content": "Ship it."},
        ],
    },
    "assistant-result": {
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "r"}]},
            {"role": "user", "content": "go on"},
        ],
    },
}


def plain(value: Any) -> Any:
    return json.loads(json.dumps(value))


def vllms(body: dict[str, Any], merge: bool) -> Any:
    return AnthropicServingMessages.to_chat_completion_request(
        AnthropicMessagesRequest.model_validate(body), merge_inline_system=merge
    )


def serving(merge: bool) -> Any:
    """vLLM's Messages serving as its start-up leaves it, for what the conversion reads of it."""
    instance = AnthropicServingMessages.__new__(AnthropicServingMessages)
    instance._merge_inline_system = merge
    return instance


@pytest.mark.parametrize("name", sorted(BODIES))
def test_kvmeshs_own_conversion_gives_vllms_messages_and_tools(name: str) -> None:
    body = {"model": "m", "max_tokens": 64, **BODIES[name]}
    tokenizer, renderer = bound()
    prompt_token_ids(tokenizer, chat_view(body), "/v1/chat/completions")
    [messages], [params] = renderer.messages, renderer.params
    chat = vllms(body, merge=False)
    assert plain(messages) == plain(chat.messages)
    theirs = None if chat.tools is None else [tool.model_dump() for tool in chat.tools]
    assert plain(params.chat_template_kwargs.get("tools")) == plain(theirs)


@pytest.mark.parametrize("merge", [False, True], ids=["inline", "merged"])
def test_inside_vllm_the_router_converts_with_vllms_own_code_and_settings(merge: bool) -> None:
    """With a template that needs system-first ordering, vLLM merges inline system messages into
    the first one; kvmesh's own conversion cannot know that, vLLM's serving does."""
    body = {"model": "m", "max_tokens": 64, **BODIES["inline-system"]}
    tokenizer, renderer = bound()
    tokenizer._messages = serving(merge)
    parse_request(
        json.dumps(body).encode(), [], "/v1/messages",
        tokenizer=tokenizer, block_size=16, lora_of=lambda _: None, clock=lambda: 0.0,
    )  # fmt: skip
    [messages] = renderer.messages
    assert plain(messages) == plain(vllms(body, merge).messages)
    assert [m["role"] for m in messages] == (["system", "user", "user"] if merge else
                                              ["system", "user", "system", "user"])  # fmt: skip


def test_a_body_vllms_messages_request_refuses_is_the_clients_400_naming_the_field() -> None:
    tokenizer, _ = bound()
    tokenizer._messages = serving(False)
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}], "top_k": "many"}
    with pytest.raises(RequestError) as e:
        parse_request(
            json.dumps(body).encode(), [], "/v1/messages",
            tokenizer=tokenizer, block_size=16, lora_of=lambda _: None, clock=lambda: 0.0,
        )  # fmt: skip
    assert e.value.status == 400 and e.value.field == "top_k"
