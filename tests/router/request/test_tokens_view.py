"""vLLM's token-in-token-out body (``/inference/v1/generate``) as the completion request it amounts
to (kvmesh/router/request/tokens_api.py), and what parse_request makes of it.

That vLLM caches such a prompt exactly so is held in vLLM's own app (tests/engines, the vLLM tier)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvmesh.errors import RequestError
from kvmesh.hashing import block_hashes
from kvmesh.router.request.parse import parse_request, prompt_recomputed
from kvmesh.router.request.tokenizer import BuiltinTokenizer
from kvmesh.router.request.tokens_api import TOKENS_PATH, completion_view

TOK = BuiltinTokenizer()
IDS = list(range(500, 580))


def parsed(body: dict[str, Any], endpoint: str = TOKENS_PATH) -> Any:
    return parse_request(
        json.dumps(body).encode(),
        [],
        endpoint,
        tokenizer=TOK,
        block_size=16,
        lora_of=lambda name: name if name == "sql-adapter" else None,
        clock=lambda: 0.0,
    )


def test_token_ids_are_hashed_as_given_as_their_completion_twin_is() -> None:
    native = parsed({"token_ids": IDS, "sampling_params": {"max_tokens": 8}})
    twin = parsed({"prompt": IDS, "max_tokens": 8}, "/v1/completions")
    assert native.tokens == twin.tokens == IDS
    assert native.hashes == twin.hashes == block_hashes(IDS, 16, None)
    adapter = parsed({"token_ids": IDS, "sampling_params": {}, "model": "sql-adapter"})
    assert adapter.lora == "sql-adapter" and adapter.hashes == block_hashes(IDS, 16, "sql-adapter")


def test_the_view_carries_the_samples_the_length_and_what_keys_the_cache() -> None:
    body = {
        "token_ids": [1, 2],
        "sampling_params": {"n": 3, "max_tokens": 5, "temperature": 0.2},
        "cache_salt": "s",
        "request_id": "r1",
    }
    assert completion_view(body) == {"prompt": [1, 2], "n": 3, "max_tokens": 5, "cache_salt": "s"}


def test_a_salted_prompt_or_one_with_media_hashes_in_a_namespace_of_its_own() -> None:
    plain = parsed({"token_ids": IDS, "sampling_params": {}})
    features = {"mm_hashes": {"image": ["abc"]}, "mm_placeholders": {"image": [{"offset": 3, "length": 20}]}}
    parts = [{"type": "image_url", "url": "https://example.invalid/a.png"}]
    for extra in ({"cache_salt": "tenant-a"}, {"features": features}, {"content_parts": parts}):
        keyed = parsed({"token_ids": IDS, "sampling_params": {}, **extra})
        assert keyed.cache_keyed == next(iter(extra))
        assert keyed.tokens == plain.tokens and not set(keyed.hashes) & set(plain.hashes)
    again = parsed({"token_ids": IDS, "sampling_params": {}, "features": features})
    other = parsed(
        {"token_ids": IDS, "sampling_params": {}, "features": {**features, "mm_hashes": {"image": ["x"]}}}
    )
    assert again.hashes == parsed({"token_ids": IDS, "sampling_params": {}, "features": features}).hashes
    assert not set(other.hashes) & set(again.hashes)  # another image: other blocks


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"sampling_params": {}}, "token_ids"),
        ({"token_ids": [], "sampling_params": {}}, "token_ids"),
        ({"token_ids": [1, -2], "sampling_params": {}}, "token_ids"),
        ({"token_ids": [1, 2**40], "sampling_params": {}}, "token_ids"),
        ({"token_ids": [1, True], "sampling_params": {}}, "token_ids"),
        ({"token_ids": [[1, 2]], "sampling_params": {}}, "token_ids"),
        ({"token_ids": "1 2", "sampling_params": {}}, "token_ids"),
        ({"token_ids": [1, 2]}, "sampling_params"),
        ({"token_ids": [1, 2], "sampling_params": [{"n": 1}]}, "sampling_params"),
        (
            {"token_ids": [1, 2], "sampling_params": {}, "nvext": {"token_data": [1, 2, 3]}},
            "nvext.token_data",
        ),
    ],
)
def test_a_body_vllm_would_refuse_is_a_400_naming_the_field(body: dict[str, Any], field: str) -> None:
    with pytest.raises(RequestError) as e:
        parsed(body)
    assert e.value.field == field


def test_nvext_is_written_where_vllm_reads_it() -> None:
    body = {
        "token_ids": IDS,
        "sampling_params": {"max_tokens": 4, "top_p": 0.9},
        "nvext": {
            "greed_sampling": True,
            "repetition_penalty": 1.1,
            "max_thinking_tokens": 64,
            "agent_hints": {"priority": 5},
        },
    }
    out = json.loads(parsed(body).engine_body("lower_first", "vllm"))
    assert "nvext" not in out and out["priority"] == -5  # vLLM: lower runs first
    assert out["sampling_params"] == {
        "max_tokens": 4,
        "temperature": 0.0,
        "top_k": 1,
        "repetition_penalty": 1.1,
        "thinking_token_budget": 64,
    }
    assert out["token_ids"] == IDS and "temperature" not in out


def test_prompt_logprobs_or_a_skipped_cache_read_mean_the_prompt_is_computed_whole() -> None:
    assert not prompt_recomputed({"token_ids": IDS, "sampling_params": {"logprobs": 2}}, TOKENS_PATH)
    assert prompt_recomputed({"token_ids": IDS, "sampling_params": {"prompt_logprobs": 0}}, TOKENS_PATH)
    assert prompt_recomputed(
        {"token_ids": IDS, "sampling_params": {"skip_reading_prefix_cache": True}}, TOKENS_PATH
    )
    assert prompt_recomputed(
        {"token_ids": IDS, "sampling_params": {"prompt_logprob_token_ids": [3]}}, TOKENS_PATH
    )
    # the request's own word wins, as in vLLM
    said = {"prompt_logprobs": 0, "skip_reading_prefix_cache": False}
    assert not prompt_recomputed({"token_ids": IDS, "sampling_params": said}, TOKENS_PATH)
    assert not prompt_recomputed({"token_ids": IDS, "prompt_logprobs": 1}, TOKENS_PATH)  # (not vLLM's place)
