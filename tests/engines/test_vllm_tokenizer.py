"""What kvmesh reads of a request as vLLM 0.33.0 reads it (engine tier): the template arguments its
tokenizer hands vLLM's renderer, and which prompts vLLM computes whole.

This machine has no model, so vLLM's renderer cannot render here; a recorder stands in for it and
keeps the ``ChatParams`` it is given. They are compared with the ones vLLM 0.33.0's own
``ChatCompletionRequest.build_chat_params`` makes from the same body: the template arguments that
change the prompt's ids (the generation prompt, ``continue_final_message``) must agree, or the
router hashes other ids than the engine caches. A prompt vLLM computes whole (prompt logprobs)
must be one the router credits with no cached block.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace
from typing import Any

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # torch's, at import
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.renderers.params import ChatParams

from kvmesh.adapters.vllm.tokenizer import VllmTokenizer
from kvmesh.router.request.parse import prompt_recomputed
from kvmesh.router.request.tokenizer import prompt_token_ids

pytestmark = pytest.mark.engine_vllm

MESSAGES = [{"role": "user", "content": "Give JSON."}, {"role": "assistant", "content": '{"a": '}]


class RecordingRenderer:
    """Stands in for vLLM's renderer: keeps the messages and the ``ChatParams`` it is given."""

    def __init__(self) -> None:
        self.messages: list[list[dict[str, Any]]] = []
        self.params: list[ChatParams] = []

    def render_messages(
        self, messages: list[dict[str, Any]], params: ChatParams
    ) -> tuple[None, dict[str, Any]]:
        self.messages.append(messages)
        self.params.append(params)
        return None, {"prompt_token_ids": [1, 2, 3]}


def bound() -> tuple[VllmTokenizer, RecordingRenderer]:
    renderer = RecordingRenderer()
    online = SimpleNamespace(
        chat_template=None, chat_template_content_format="auto", default_chat_template_kwargs={}
    )
    app = SimpleNamespace(
        state=SimpleNamespace(online_renderer=online, engine_client=SimpleNamespace(renderer=renderer))
    )
    tokenizer = VllmTokenizer()
    tokenizer.bind_from_app(app)
    return tokenizer, renderer


@pytest.mark.parametrize(
    "fields",
    [
        {"add_generation_prompt": False, "continue_final_message": True},
        {"add_generation_prompt": False},
        {},
    ],
    ids=["continued", "no-generation-prompt", "defaults"],
)
def test_the_template_arguments_are_vllms_own(fields: dict[str, Any]) -> None:
    tokenizer, renderer = bound()
    body = {"model": "m", "messages": MESSAGES, **fields}
    assert prompt_token_ids(tokenizer, body, "/v1/chat/completions") == [1, 2, 3]
    ours = renderer.params[0].chat_template_kwargs
    vllms = ChatCompletionRequest.model_validate(body).build_chat_params(None, "auto").chat_template_kwargs
    for key in ("add_generation_prompt", "continue_final_message"):
        assert ours.get(key, False) == vllms.get(key, False), key


@pytest.mark.parametrize(
    ("endpoint", "fields"),
    [
        ("/v1/chat/completions", {"prompt_logprobs": 1}),
        ("/v1/chat/completions", {"echo": True}),
        ("/v1/chat/completions", {"echo": True, "top_logprobs": 3, "logprobs": True}),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 3}),
        ("/v1/chat/completions", {}),
        ("/v1/completions", {"prompt_logprobs": 0}),
        ("/v1/completions", {"echo": True, "logprobs": 2}),
        ("/v1/completions", {"echo": True}),
        ("/v1/completions", {"logprobs": 2}),
        ("/v1/completions", {}),
    ],
)
def test_the_prompts_vllm_computes_whole_are_the_routers(endpoint: str, fields: dict[str, Any]) -> None:
    """``prompt_recomputed`` against vLLM 0.33.0's own request classes: the sampling parameters
    they make skip reading the prefix cache exactly where the router credits no cached block."""
    chat = endpoint.endswith("chat/completions")
    body: dict[str, Any] = {"model": "m", **fields}
    body.update({"messages": MESSAGES[:1]} if chat else {"prompt": "x"})
    request = (ChatCompletionRequest if chat else CompletionRequest).model_validate(body)
    params = request.to_sampling_params(16, {})
    assert prompt_recomputed(body, endpoint) is bool(params.skip_reading_prefix_cache)
