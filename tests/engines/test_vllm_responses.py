"""A Responses API body read as vLLM 0.33.0 reads it (engine tier).

vLLM renders ``POST /v1/responses`` as a chat prompt: ``construct_input_messages`` turns the
instructions and input items into messages, ``construct_tool_dicts`` the function tools into chat
tool definitions, and ``ResponsesRequest.build_chat_params`` decides the generation prompt (an
assistant message left ``in_progress`` is continued instead). kvmesh's router does the same on its
own (``kvmesh.router.request.responses_api.chat_view``) and hands the result to vLLM's renderer
through its tokenizer; whatever differs, the router hashes other ids than the engine caches.

This machine has no model, so vLLM's renderer cannot render here: a recorder stands in for it and
keeps the messages and template arguments kvmesh gives it, which must equal vLLM's own.
"""

from __future__ import annotations

import json
import warnings
from typing import Any

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # torch's, at import
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
    from vllm.entrypoints.openai.responses.utils import construct_input_messages, construct_tool_dicts

from kvmesh.router.request.responses_api import chat_view
from kvmesh.router.request.tokenizer import prompt_token_ids
from tests.engines.test_vllm_tokenizer import bound

pytestmark = pytest.mark.engine_vllm

TOOLS = [
    {
        "type": "function",
        "name": "lookup",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
    },
    {
        "type": "function",
        "name": "save",
        "description": "Save a note",
        "parameters": {"type": "object"},
        "strict": True,
    },
    {"type": "web_search_preview"},
]
BODIES = {
    "text": {"input": "What is a KV cache?"},
    "instructions": {"instructions": "Answer in one line.", "input": "What is a KV cache?"},
    "messages": {
        "input": [
            {"role": "developer", "content": "Be terse."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
            },
        ]
    },
    "tool-round": {
        "instructions": "Use the tools.",
        "tools": TOOLS,
        "input": [
            {"role": "user", "content": "Find the note about caching."},
            {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": '{"q": "caching"}'},
            {"type": "function_call", "call_id": "call_2", "name": "lookup", "arguments": '{"q": "kv"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "note 7"},
            {"type": "function_call_output", "call_id": "call_2", "output": "note 9"},
        ],
    },
    "reasoning-then-answer": {
        "input": [
            {"role": "user", "content": "q"},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "think"}],
            },
            {
                "type": "message",
                "id": "msg_1",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": "answer", "annotations": []}],
            },
            {"role": "user", "content": "and then?"},
        ]
    },
    "continued": {
        "input": [
            {"role": "user", "content": "Give JSON."},
            {
                "type": "message",
                "role": "assistant",
                "status": "in_progress",
                "content": [{"type": "output_text", "text": '{"a": '}],
            },
        ]
    },
}


def plain(value: Any) -> Any:
    return json.loads(json.dumps(value))


@pytest.mark.parametrize("name", sorted(BODIES))
def test_kvmesh_renders_a_responses_body_as_vllm_does(name: str) -> None:
    body = {"model": "m", **BODIES[name]}
    tokenizer, renderer = bound()
    prompt_token_ids(tokenizer, chat_view(body), "/v1/chat/completions")
    [messages], [params] = renderer.messages, renderer.params
    request = ResponsesRequest.model_validate(body)
    vllm_messages = construct_input_messages(
        request_instructions=request.instructions, request_input=request.input
    )
    assert plain(messages) == plain(vllm_messages)
    ours = params.chat_template_kwargs
    assert plain(ours.get("tools")) == plain(construct_tool_dicts(request.tools, request.tool_choice))
    vllms = request.build_chat_params(None, "auto").chat_template_kwargs
    for key in ("add_generation_prompt", "continue_final_message"):
        assert ours.get(key, False) == vllms.get(key, False), key
