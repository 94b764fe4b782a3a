"""SageMaker's ``/invocations`` read as vLLM 0.33.0 reads it (engine tier; kvmesh.router.request
.invocations and kvmesh.mock.invocations).

vLLM serves ``/invocations`` by validating the body against its generation request types in
order (``get_generate_invocation_types``: chat first, then completion) and serving the first that
fits. kvmesh routes the body as the request it names by its fields; here each body is validated
against vLLM's own types, in vLLM's order, and the endpoint it lands on must be kvmesh's. vLLM's
SageMaker route itself, behind kvmesh's middleware: ``test_vllm_sagemaker.py``.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # torch's, at import
    import pydantic
    from vllm.entrypoints.generate.factories import get_generate_invocation_types
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.exceptions import VLLMValidationError

from kvmesh.router.request.invocations import invoked_endpoint

pytestmark = pytest.mark.engine_vllm

CHAT = [{"role": "user", "content": "hello"}]


def _vllms_choice(body: dict[str, Any]) -> str | None:
    """The endpoint vLLM serves ``body`` at on /invocations, for a generating model. None: no
    generation type takes it, and vLLM refuses it (its completion type's own check, naming
    ``prompt``, ends the search with a 400 before any pooling type is tried)."""
    endpoints = {ChatCompletionRequest: "/v1/chat/completions", CompletionRequest: "/v1/completions"}
    for request_type, _handlers in get_generate_invocation_types(("generate",)):
        try:
            pydantic.TypeAdapter(request_type).validate_python(body)
        except pydantic.ValidationError:
            continue
        except VLLMValidationError as e:
            assert e.parameter == "prompt"
            return None
        return endpoints[request_type]
    return None


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m", "messages": CHAT},
        {"model": "m", "messages": CHAT, "stream": True, "max_tokens": 3},
        {"model": "m", "prompt": "hello"},
        {"model": "m", "prompt": [1, 2, 3]},
        {"model": "m", "prompt": ["a", "b"], "max_tokens": 2},
        {"model": "m", "messages": CHAT, "prompt": "both: chat comes first"},
        {"model": "m", "input": "an embedding request, to a generating model"},
    ],
    ids=["chat", "chat-stream", "completion", "token-ids", "batch", "both", "embedding"],
)
def test_kvmesh_reads_an_invocation_as_vllm_serves_it(body: dict[str, Any]) -> None:
    """A body kvmesh routes lands on the endpoint it was routed as; one it passes on unrouted
    (None) is one vLLM does not serve as a generation either."""
    assert invoked_endpoint(body) == _vllms_choice(body)
