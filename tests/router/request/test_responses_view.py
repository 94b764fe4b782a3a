"""A Responses API body as the chat request an engine renders (kvmesh/router/request/responses_api.py).

The conversion itself is held to vLLM 0.33.0's own functions in the engine tier
(tests/engines/test_vllm_responses.py) and to SGLang's serving in SGLang's app; here: what the
router adds around it, with no engine installed.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvmesh.errors import RequestError
from kvmesh.hashing import block_hashes
from kvmesh.router.request.parse import parse_request
from kvmesh.router.request.responses_api import ResponseHomes, chat_view, rendered_as_chat
from kvmesh.router.request.tokenizer import BuiltinTokenizer, prompt_token_ids

TOK = BuiltinTokenizer()


def parsed(body: bytes, endpoint: str) -> Any:
    return parse_request(
        body, [], endpoint, tokenizer=TOK, block_size=16, lora_of=lambda _: None, clock=lambda: 0.0
    )


def test_a_responses_body_hashes_to_the_blocks_of_its_chat_twin() -> None:
    system = "Answer from the contract. " * 20
    chat = parsed(
        b'{"messages": [{"role": "system", "content": "%s"}, {"role": "user", "content": "Renewals?"}]}'
        % system.encode(),
        "/v1/chat/completions",
    )
    responses = parsed(
        b'{"instructions": "%s", "input": [{"role": "user", "content": [{"type": "input_text", '
        b'"text": "Renewals?"}]}]}' % system.encode(),
        "/v1/responses",
    )
    assert responses.tokens == chat.tokens
    assert responses.hashes == chat.hashes == block_hashes(chat.tokens, 16, None)


def test_what_keys_the_cache_keys_the_hashes() -> None:
    plain = parsed(b'{"input": "hello there " }', "/v1/responses")
    salted = parsed(b'{"input": "hello there ", "cache_salt": "tenant-a"}', "/v1/responses")
    effort = parsed(b'{"input": "hello there ", "reasoning": {"effort": "high"}}', "/v1/responses")
    assert (plain.cache_keyed, salted.cache_keyed, effort.cache_keyed) == (
        None,
        "cache_salt",
        "chat_template_kwargs",
    )
    assert len({plain.hashes[0], salted.hashes[0], effort.hashes[0]}) == 3


def test_an_assistant_message_left_open_is_continued() -> None:
    view = chat_view(
        {
            "input": [
                {"role": "user", "content": "JSON, please."},
                {
                    "type": "message",
                    "role": "assistant",
                    "status": "incomplete",
                    "content": [{"type": "output_text", "text": '{"a": '}],
                },
            ]
        }
    )
    assert (view["add_generation_prompt"], view["continue_final_message"]) == (False, True)
    ids = prompt_token_ids(TOK, view, "chat")
    assert TOK.decode(ids).endswith('{"a": ')  # the answer goes on from the client's start


class _Invalid(Exception):
    """What pydantic raises: ``errors()`` with each error's location."""

    def errors(self) -> list[dict[str, Any]]:
        return [{"loc": ("temperature",), "msg": "Input should be a valid number"}]


class _EngineRenders:
    """A tokenizer whose engine renders Responses bodies its own way (as SGLang's adapter does)."""

    def __init__(self, rendered: dict[str, Any] | None = None, error: Exception | None = None) -> None:
        self.rendered, self.error = rendered, error

    def responses_as_chat(self, body: dict[str, Any]) -> dict[str, Any] | None:
        if self.error is not None:
            raise self.error
        return self.rendered


def test_an_engine_that_renders_its_own_way_is_followed_and_its_refusal_names_the_field() -> None:
    body = {"input": "hi", "cache_salt": "s", "model": "m"}
    own = {"messages": [{"role": "system", "content": "labelled"}, {"role": "user", "content": "hi"}]}
    view = rendered_as_chat(body, _EngineRenders(own))
    assert view["messages"] == own["messages"]
    assert (view["cache_salt"], view["model"]) == ("s", "m")  # what keys the cache is kept
    assert rendered_as_chat(body, _EngineRenders(None)) == chat_view(body)  # no serving: vLLM's way
    with pytest.raises(RequestError) as refused:
        rendered_as_chat(body, _EngineRenders(error=_Invalid("1 validation error")))
    assert refused.value.field == "temperature"
    with pytest.raises(RequestError) as refused:
        rendered_as_chat(body, _EngineRenders(error=ValueError("Unsupported item")))
    assert refused.value.field == "input"


def test_homes_keep_the_newest() -> None:
    homes = ResponseHomes(capacity=2)
    for i in range(3):
        homes.remember(f"resp_{i}", f"w{i}")
    homes.remember("resp_1", "w1")  # asked of again: the newest
    homes.remember("resp_3", "w3")
    assert [homes.home(f"resp_{i}") for i in range(4)] == [None, "w1", None, "w3"]
    assert len(homes) == 2
