"""The mock's Responses API (``POST /v1/responses``), driven by the official openai client on loopback.

The mock serves it as vLLM 0.33.0 does with its store on: the answer as a ``response`` object (or
vLLM's event stream, ``response.completed`` last), ``usage`` in the Responses API's names, the
conversation stored for ``previous_response_id`` unless ``store`` is false.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from kvmesh.mock.testing import run_mock
from kvmesh.router.request.tokenizer import BuiltinTokenizer

pytestmark = pytest.mark.e2e

MODEL = "kvmesh-mock"
INSTRUCTIONS = "You are a helpful assistant who answers briefly. " * 12


def _client(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)


async def test_openai_client_responses_whole_and_streamed() -> None:
    async with run_mock(block_size=16, num_blocks=256, speedup=20) as mock, _client(mock.base_url) as client:
        first = await client.responses.create(
            model=MODEL, instructions=INSTRUCTIONS, input="Say hello.", max_output_tokens=6
        )
        assert first.object == "response" and first.status == "completed"
        assert first.output_text
        rendered = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "Say hello."}]
        prompt_len = len(BuiltinTokenizer().apply_chat_template(rendered))
        assert first.usage is not None
        assert first.usage.input_tokens == prompt_len  # rendered as the chat request it stands for
        assert first.usage.output_tokens == 6
        assert first.usage.input_tokens_details.cached_tokens == 0

        kinds: list[str] = []
        text = ""
        completed = None
        stream = await client.responses.create(
            model=MODEL, instructions=INSTRUCTIONS, input="Say hello.", max_output_tokens=6, stream=True
        )
        async for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                text += event.delta
            if event.type == "response.completed":
                completed = event.response
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert kinds[-1] == "response.completed"
        assert completed is not None and completed.output_text == text == first.output_text  # same seed
        assert completed.usage is not None
        assert completed.usage.input_tokens_details.cached_tokens == (prompt_len - 1) // 16 * 16


async def test_a_stored_response_is_continued_and_an_unknown_one_is_a_404() -> None:
    async with run_mock(block_size=16, num_blocks=256, speedup=20) as mock, _client(mock.base_url) as client:
        first = await client.responses.create(
            model=MODEL, instructions=INSTRUCTIONS, input="Name a colour.", max_output_tokens=5
        )
        later = await client.responses.create(
            model=MODEL, previous_response_id=first.id, input="And another?", max_output_tokens=5
        )
        assert later.previous_response_id == first.id
        fetched = await client.responses.retrieve(first.id)
        assert (fetched.id, fetched.output_text) == (first.id, first.output_text)
        history = [
            {"role": "user", "content": "Name a colour."},  # (instructions do not carry over)
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And another?"},
        ]
        assert later.usage is not None
        assert later.usage.input_tokens == len(BuiltinTokenizer().apply_chat_template(history))

        unstored = await client.responses.create(
            model=MODEL, input="Forget me.", max_output_tokens=2, store=False
        )
        for missing in (unstored.id, "resp_nobody"):
            with pytest.raises(openai.NotFoundError):
                await client.responses.create(model=MODEL, previous_response_id=missing, input="x")
            with pytest.raises(openai.NotFoundError):
                await client.responses.retrieve(missing)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"input": "x", "background": True}, "background"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "store": "yes"}, "store"),
        ({"input": "x", "top_k": -5}, "top_k"),  # (vLLM's Responses request takes its sampling fields)
        ({"input": "x", "stop": 5}, "stop"),
    ],
)
async def test_a_body_the_engine_cannot_serve_is_a_400_naming_the_field(body: dict, field: str) -> None:  # type: ignore[type-arg]
    async with run_mock(speedup=20) as mock, httpx.AsyncClient() as http:
        r = await http.post(mock.base_url + "/v1/responses", json={"model": MODEL, **body})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == field
