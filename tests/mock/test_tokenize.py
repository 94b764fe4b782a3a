"""The mock's utility endpoints (``/v1/messages/count_tokens``, ``/tokenize``, ``/detokenize``),
driven over HTTP on loopback: a prompt's count is what its generation request reports."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from kvmesh.mock.testing import run_mock
from tests.mock.test_messages import BODY, TOOLS

pytestmark = pytest.mark.e2e

CHAT: dict[str, Any] = {
    "model": "kvmesh-mock",
    "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}],
}


async def test_a_count_is_the_prompt_its_generation_request_reports() -> None:
    async with (
        run_mock(block_size=16, speedup=50.0) as mock,
        httpx.AsyncClient(base_url=mock.base_url) as http,
    ):
        for body in (BODY, {**BODY, "tools": TOOLS}):
            asked = {k: v for k, v in body.items() if k != "max_tokens"}  # (a count takes none)
            count = await http.post("/v1/messages/count_tokens", json=asked)
            assert count.status_code == 200, count.text
            served = await http.post("/v1/messages", json=body)
            usage = served.json()["usage"]
            assert count.json() == {
                "input_tokens": usage["input_tokens"] + usage.get("cache_read_input_tokens", 0)
            }
        tokens = await http.post("/tokenize", json=CHAT)
        served = await http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1})
        doc = tokens.json()
        assert doc["count"] == len(doc["tokens"]) == served.json()["usage"]["prompt_tokens"]
        assert doc["max_model_len"] > doc["count"] and doc["token_strs"] is None
        prompt = await http.post("/tokenize", json={"model": "kvmesh-mock", "prompt": "Hello there"})
        back = await http.post("/detokenize", json={"tokens": prompt.json()["tokens"]})
        assert back.json() == {"prompt": "Hello there"}


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/messages/count_tokens", {"model": "kvmesh-mock"}, "messages"),
        ("/v1/messages/count_tokens", [1], "body"),
        ("/tokenize", {"model": "kvmesh-mock", "prompt": ""}, "prompt"),
        ("/tokenize", {"model": "other", "prompt": "x"}, "model"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": "1 2"}, "tokens"),
        ("/v1/messages/count_tokens", "deep", "body"),
    ],
)
async def test_a_bad_body_is_a_400_naming_the_field(path: str, body: Any, field: str) -> None:
    async with (
        run_mock(block_size=16, speedup=50.0) as mock,
        httpx.AsyncClient(base_url=mock.base_url) as http,
    ):
        if body == "deep":  # (nested past the interpreter's recursion limit: it was a 500)
            r = await http.post(path, content=b'{"metadata": ' + b"[" * 5000 + b"]" * 5000 + b"}")
        else:
            r = await http.post(path, json=body)
        assert 400 <= r.status_code < 500 and r.json()["error"]["param"] == field, r.text
