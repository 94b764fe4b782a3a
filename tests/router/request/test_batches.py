"""A batch of prompts cut into one request per prompt (kvmesh/router/request/batches.py), as
SGLang's ``GenerateReqInput`` gives each prompt its fields, and as parse_request raises it."""

from __future__ import annotations

from typing import Any

import pytest

from kvmesh.errors import RequestError
from kvmesh.router.request.batches import PromptBatch, item_field, split_batch
from tests.router.request.test_generate_view import parsed


def test_each_prompt_gets_its_own_entry_of_a_per_prompt_list_and_the_rest_whole() -> None:
    body = {
        "text": ["a b", "c d", "e"],
        "rid": "job",
        "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 2}, {"max_new_tokens": 3}],
        "return_logprob": [True, False, True],
        "token_ids_logprob": [[1], [2], [3]],
        "image_data": "http://h/cat.png",  # (one image: every prompt's, as SGLang takes it)
        "cache_salt": "s",
        "stream": True,
    }
    batch = split_batch(body, "/generate")
    assert batch is not None and batch.samples == 1
    assert [i["text"] for i in batch.items] == ["a b", "c d", "e"]
    assert [i["rid"] for i in batch.items] == ["job_0", "job_1", "job_2"]
    assert [i["sampling_params"]["max_new_tokens"] for i in batch.items] == [1, 2, 3]
    assert [i["return_logprob"] for i in batch.items] == [True, False, True]
    assert [i["token_ids_logprob"] for i in batch.items] == [[1], [2], [3]]
    assert all(i["image_data"] == "http://h/cat.png" and i["cache_salt"] == "s" for i in batch.items)
    assert all(i["stream"] is True for i in batch.items)
    assert {"text", "rid", "sampling_params", "return_logprob", "token_ids_logprob"} == batch.split
    # One token-id list for every prompt stays whole; a rid list gives each prompt its own.
    ids = split_batch(
        {"input_ids": [[1, 2], [3]], "token_ids_logprob": [7, 8], "rid": ["x", "y"]}, "/generate"
    )
    assert ids is not None
    assert [(i["input_ids"], i["token_ids_logprob"], i["rid"]) for i in ids.items] == [
        ([1, 2], [7, 8], "x"),
        ([3], [7, 8], "y"),
    ]


@pytest.mark.parametrize(
    ("params", "samples"),
    [
        (None, 1),
        ({"n": 3}, 3),
        ([{"n": 2}, {"n": 2}], 2),
        ({"n": 4, "beam_width": 2}, 1),  # (beam search: n is the beams it returns, one request)
    ],
)
def test_samples_per_prompt_are_counted_as_sglang_counts_them(params: Any, samples: int) -> None:
    body: dict[str, Any] = {"text": ["a", "b"]}
    if params is not None:
        body["sampling_params"] = params
    batch = split_batch(body, "/generate")
    assert batch is not None and batch.samples == samples


def test_one_prompt_is_not_a_batch() -> None:
    for body, endpoint in (
        ({"text": "a"}, "/generate"),
        ({"input_ids": [1, 2, 3]}, "/generate"),
        ({"prompt": "a"}, "/v1/completions"),
        ({"prompt": [1, 2, 3]}, "/v1/completions"),
        ({"prompt": ["a"]}, "/v1/completions"),  # (vLLM answers a batch of one as one prompt)
    ):
        assert split_batch(body, endpoint) is None


def test_a_completions_batch_keeps_every_field_but_the_prompt() -> None:
    batch = split_batch({"prompt": ["a", [5, 6]], "n": 2, "max_tokens": 3, "model": "m"}, "/v1/completions")
    assert batch is not None and batch.samples == 2 and batch.split == {"prompt"}
    assert batch.items == [
        {"prompt": "a", "n": 2, "max_tokens": 3, "model": "m"},
        {"prompt": [5, 6], "n": 2, "max_tokens": 3, "model": "m"},
    ]


def test_parse_request_raises_the_batch_instead_of_parsing_one_request() -> None:
    with pytest.raises(PromptBatch) as e:
        parsed({"text": ["a", "b"]})
    assert len(e.value.items) == 2
    with pytest.raises(PromptBatch):
        parsed({"prompt": ["a", "b"], "model": "m"}, "/v1/completions")
    # A batch bound to its engine (a PD hand-off) is served there whole, not cut.
    assert parsed({"text": ["a", "b"], "bootstrap_room": [1, 2]}).body["text"] == ["a", "b"]
    # The prompt of a chat request is never a batch.
    chat = {"messages": [{"role": "user", "content": "hi"}], "prompt": ["a", "b"]}
    assert parsed(chat, "/v1/chat/completions").tokens


@pytest.mark.parametrize(
    ("body", "endpoint", "field"),
    [
        ({"text": ["a", "b"], "sampling_params": [{}]}, "/generate", "sampling_params"),
        ({"text": ["a", "b"], "lora_path": ["x", "y", "z"]}, "/generate", "lora_path"),
        ({"text": ["a", ["b"]]}, "/generate", "text[1]"),
        ({"input_ids": [[1], [[2]]]}, "/generate", "input_ids[1]"),
        ({"text": ["a", "b"], "sampling_params": [{"n": 1}, {"n": 2}]}, "/generate", "sampling_params"),
        ({"text": ["a", "b"], "nvext": {"annotations": ["token_ids"]}}, "/generate", "nvext.annotations"),
        ({"prompt": ["a", ["b"]]}, "/v1/completions", "prompt[1]"),
        ({"prompt": ["a", None]}, "/v1/completions", "prompt[1]"),
        (
            {"prompt": ["a", "b"], "nvext": {"extra_fields": ["timing"]}},
            "/v1/completions",
            "nvext.extra_fields",
        ),
        ({"prompt": ["a"] * 1025}, "/v1/completions", "prompt"),
    ],
)
def test_a_batch_the_engine_would_refuse_is_a_400_naming_the_field(
    body: dict[str, Any], endpoint: str, field: str
) -> None:
    with pytest.raises(RequestError) as e:
        split_batch(body, endpoint)
    assert e.value.status == 400 and e.value.field == field, e.value


def test_a_prompts_error_names_its_place_in_the_batchs_body() -> None:
    split = frozenset(("text", "sampling_params"))
    assert item_field("text", split, 2) == "text[2]"
    assert item_field("sampling_params.max_new_tokens", split, 1) == "sampling_params[1].max_new_tokens"
    assert item_field("max_tokens", split, 1) == "max_tokens"
    assert item_field(None, split, 1) is None
