"""A chat batch put back together as vLLM 0.33.0 answers it (engine tier).

The router serves each conversation of a ``/v1/chat/completions/batch`` request as a chat request
of its own, then merges the answers (kvmesh/router/asgi/batches.py). Here vLLM's own serving
classes turn the same engine outputs into answers twice: ``OpenAIServingChat`` once for each
conversation alone, ``OpenAIServingChatBatch`` once for the whole batch. kvmesh's merge of the
first must be the second.
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import AsyncIterator
from typing import Any

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # torch's, at import
    from vllm.entrypoints.generate.base.protocol import RequestResponseMetadata
    from vllm.entrypoints.openai.chat_completion.batch_serving import OpenAIServingChatBatch
    from vllm.entrypoints.openai.chat_completion.protocol import BatchChatCompletionRequest
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.outputs import CompletionOutput, RequestOutput

    from kvmesh.router.asgi.batches import merged_completion

pytestmark = pytest.mark.engine_vllm

CONVERSATIONS = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}],
    [{"role": "user", "content": "Count to three."}],
    [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello."},
     {"role": "user", "content": "Again."}],
]  # fmt: skip


def _result(i: int) -> RequestOutput:
    output = CompletionOutput(
        index=0,
        text=f"answer {i}",
        token_ids=list(range(40, 42 + i)),
        cumulative_logprob=None,
        logprobs=None,
        finish_reason="length" if i else "stop",
    )
    return RequestOutput(
        f"r{i}", f"prompt {i}", list(range(10 * i, 10 * i + 5 + i)), None, [output], finished=True
    )


async def _once(result: RequestOutput) -> AsyncIterator[RequestOutput]:
    yield result


def _with_answer_half(serving: Any) -> Any:
    """The attributes the answer-making methods read, as a server with default flags sets them."""
    serving.response_role = "assistant"
    serving.system_fingerprint = None
    serving.enable_auto_tools = False
    serving.parser_cls = None
    serving.enable_prompt_tokens_details = False
    serving.enable_per_request_metrics = False
    serving.reasoning_parser_cls = None
    serving._include_reasoning_tokens_details = False
    serving.enable_log_outputs = False
    serving.request_logger = None
    return serving


def test_the_merged_answer_of_a_batchs_conversations_is_vllms_answer_to_the_batch() -> None:
    body = {"model": "m", "messages": CONVERSATIONS, "max_tokens": 4}
    batch_request = BatchChatCompletionRequest.model_validate(body)
    results = [_result(i) for i in range(len(CONVERSATIONS))]

    async def answers() -> tuple[list[dict[str, Any]], dict[str, Any]]:
        single = _with_answer_half(OpenAIServingChat.__new__(OpenAIServingChat))
        alone = []
        for conversation, result in zip(CONVERSATIONS, results, strict=True):
            request = batch_request.to_chat_completion_request(conversation)  # (a conversation's body)
            response = await single.chat_completion_full_generator(
                request, _once(result), "chatcmpl-1", "m", conversation, None,
                RequestResponseMetadata(request_id="chatcmpl-1"),
            )  # fmt: skip
            alone.append(response.model_dump(mode="json"))
        batch = _with_answer_half(OpenAIServingChatBatch.__new__(OpenAIServingChatBatch))
        whole = await batch.chat_completion_full_generator_batch(
            batch_request, [_once(r) for r in results], "chatcmpl-1", "m", CONVERSATIONS, None,
            RequestResponseMetadata(request_id="chatcmpl-1"),
        )  # fmt: skip
        return alone, whole.model_dump(mode="json")

    alone, whole = asyncio.run(answers())
    merged = merged_completion(alone, 1)
    assert merged is not None
    for doc in (merged, whole):
        doc.pop("created")  # (the clock's second)
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2]
    assert whole["usage"]["prompt_tokens"] == 5 + 6 + 7
    assert merged == whole
