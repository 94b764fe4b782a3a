"""SGLang's ``/generate`` body as the completion request it amounts to
(kvmesh/router/request/generate_api.py), and what parse_request makes of it.

That SGLang tokenizes it exactly so is held in SGLang's own app (tests/engines, the SGLang tier)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvmesh.errors import RequestError
from kvmesh.hashing import block_hashes
from kvmesh.router.request.generate_api import bound_to_engine, completion_view, meta_usage
from kvmesh.router.request.parse import parse_request
from kvmesh.router.request.tokenizer import BuiltinTokenizer

TOK = BuiltinTokenizer()
TEXT = "Summarise the quarterly report for the board in three short bullet points. " * 6


def parsed(body: dict[str, Any], endpoint: str = "/generate") -> Any:
    return parse_request(
        json.dumps(body).encode(),
        [],
        endpoint,
        tokenizer=TOK,
        block_size=16,
        lora_of=lambda _: None,
        clock=lambda: 0.0,
    )


def test_a_generate_text_hashes_to_the_blocks_of_its_completion_twin() -> None:
    native = parsed({"text": TEXT, "sampling_params": {"max_new_tokens": 8}})
    twin = parsed({"prompt": TEXT, "max_tokens": 8}, "/v1/completions")
    assert native.tokens == twin.tokens == TOK.encode(TEXT)
    assert native.hashes == twin.hashes == block_hashes(TOK.encode(TEXT), 16, None)


def test_token_ids_are_hashed_as_given_and_text_wins_when_both_are_sent() -> None:
    ids = list(range(100, 150))
    assert parsed({"input_ids": ids}).tokens == ids
    assert parsed({"text": TEXT, "input_ids": ids}).tokens == TOK.encode(TEXT)  # as SGLang reads it


def test_the_view_carries_the_samples_the_length_and_what_keys_the_cache() -> None:
    view = completion_view(
        {"text": "x", "sampling_params": {"n": 3, "max_new_tokens": 5, "temperature": 0.2}, "cache_salt": "s"}
    )
    assert view == {"prompt": "x", "n": 3, "max_tokens": 5, "cache_salt": "s"}


def test_a_salted_or_adapter_prompt_hashes_in_a_namespace_of_its_own() -> None:
    plain = parsed({"text": TEXT})
    for extra in ({"cache_salt": "tenant-a"}, {"lora_path": "sql-adapter"}, {"extra_key": "k"}):
        keyed = parsed({"text": TEXT, **extra})
        assert keyed.cache_keyed == next(iter(extra))
        assert keyed.tokens == plain.tokens and not set(keyed.hashes) & set(plain.hashes)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"text": []}, "text"),
        ({"text": ["a", 7]}, "text[1]"),
        ({"text": ""}, "text"),
        ({"text": 7}, "text"),
        ({"input_ids": [[1, 2], "3"]}, "input_ids[1]"),
        ({"input_ids": []}, "input_ids"),
        ({"input_ids": "1 2 3"}, "input_ids"),
        ({"sampling_params": {"max_new_tokens": 4}}, "text"),
        ({"text": "x", "sampling_params": [{"n": 1}]}, "sampling_params"),
        ({"text": "x", "sampling_params": "greedy"}, "sampling_params"),
        ({"input_embeds": [[0.1, 0.2]]}, "input_embeds"),
        ({"text": "x", "nvext": {"token_data": [1, 2, 3]}}, "nvext.token_data"),
    ],
)
def test_what_is_not_routed_is_a_400_naming_the_field(body: dict[str, Any], field: str) -> None:
    with pytest.raises(RequestError) as e:
        parsed(body)
    assert e.value.status == 400 and e.value.field == field


def test_a_session_or_a_hand_off_is_bound_to_its_engine_and_not_tokenized() -> None:
    assert bound_to_engine({"text": "x"}) is None
    for field, value in (("session_params", {"id": "s1"}), ("bootstrap_room", 7), ("bootstrap_host", "h")):
        body = {"input_ids": [], field: value}  # (a session's history may be its whole prompt)
        assert bound_to_engine(body) == field
        request = parsed(body)
        assert request.tokens == [] and request.hashes == []


def test_nvext_goes_to_the_engine_in_sglangs_own_places() -> None:
    body = {
        "text": "x",
        "sampling_params": {"max_new_tokens": 4, "top_p": 0.5},
        "nvext": {"greed_sampling": True, "ignore_eos": True, "agent_hints": {"priority": 3}},
    }
    out = json.loads(parsed(body).engine_body("lower_first", "sglang"))
    assert "nvext" not in out and "ignore_eos" not in out and "temperature" not in out
    assert out["priority"] == -3
    assert out["sampling_params"] == {"max_new_tokens": 4, "ignore_eos": True, "temperature": 0.0, "top_k": 1}
    budget = json.loads(
        parsed({"text": "x", "nvext": {"max_thinking_tokens": 64}}).engine_body("none", "sglang")
    )
    assert budget["max_thinking_tokens"] == 64 and "sampling_params" not in budget


def test_meta_usage_reads_the_prompt_once_and_sums_the_answers() -> None:
    metas = {
        1: {"prompt_tokens": 30, "cached_tokens": 16, "completion_tokens": 5},
        0: {"prompt_tokens": 30, "cached_tokens": 16, "completion_tokens": 7},
    }
    assert meta_usage(metas) == {
        "prompt_tokens": 30,
        "completion_tokens": 12,
        "prompt_tokens_details": {"cached_tokens": 16},
    }
    assert meta_usage({}) is None
    assert meta_usage({0: {"prompt_tokens": 3, "completion_tokens": "many"}}) is None
