"""A completions batch put back together as vLLM 0.33.0 answers it (engine tier).

The router serves each prompt of a batch as a request of its own, then merges the answers
(kvmesh/router/asgi/batches.py). Here vLLM's own ``OpenAIServingCompletion`` turns the same engine
outputs into answers twice: once for each prompt alone, once for the whole batch. kvmesh's merge
of the first must be the second.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # torch's, at import
    from vllm.entrypoints.generate.base.protocol import RequestResponseMetadata
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.outputs import CompletionOutput, RequestOutput

    from kvmesh.router.asgi.batches import merged_completion

pytestmark = pytest.mark.engine_vllm


def _served(prompts: Any, results: list[RequestOutput], n: int) -> dict[str, Any]:
    """vLLM's answer to a completion request of ``prompts`` whose engine outputs are ``results``."""
    serving = OpenAIServingCompletion.__new__(OpenAIServingCompletion)  # (its answer-making half)
    serving.enable_prompt_tokens_details = False
    serving.enable_per_request_metrics = False
    serving.system_fingerprint = None
    request = CompletionRequest(model="m", prompt=prompts, n=n, max_tokens=4)
    response = serving.request_output_to_completion_response(
        results, request, "cmpl-1", 1700000000, "m", None, RequestResponseMetadata(request_id="cmpl-1")
    )
    return response.model_dump(mode="json")


def _result(prompt: str, ids: list[int], texts: list[str]) -> RequestOutput:
    outputs = [
        CompletionOutput(
            index=j,
            text=text,
            token_ids=[40 + j, 41 + j],
            cumulative_logprob=None,
            logprobs=None,
            finish_reason="length",
        )
        for j, text in enumerate(texts)
    ]
    return RequestOutput("r", prompt, ids, None, outputs, finished=True)


@pytest.mark.parametrize("n", [1, 2])
def test_the_merged_answer_of_a_batchs_prompts_is_vllms_answer_to_the_batch(n: int) -> None:
    prompts = ["the quick brown fox", "jumps over", "the lazy dog again"]
    results = [
        _result(p, list(range(10 * i, 10 * i + 3 + i)), [f"answer {i}.{j}" for j in range(n)])
        for i, p in enumerate(prompts)
    ]
    whole = _served(prompts, results, n)
    parts = [_served(p, [r], n) for p, r in zip(prompts, results, strict=True)]
    assert merged_completion(parts, n) == whole
    assert [c["index"] for c in whole["choices"]] == list(range(3 * n))  # (vLLM's own numbering)
