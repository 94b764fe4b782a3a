"""The mock's ``POST /invocations`` (kvmesh.mock.invocations), over HTTP against a running mock: a
body served as the chat request, completion or embedding request it is, as vLLM 0.33 serves it;
stateful sessions opened, used, closed and expired; every refusal names the field."""

from __future__ import annotations

import re

import httpx
import pytest

from kvmesh.mock import invocations
from kvmesh.mock.testing import run_mock

pytestmark = pytest.mark.e2e

MODEL = "kvmesh-mock"
SESSION = "X-Amzn-SageMaker-Session-Id"


async def _open(http: httpx.AsyncClient) -> str:
    r = await http.post("/invocations", json={"requestType": "NEW_SESSION"})
    assert r.status_code == 200, r.text
    opened = r.headers["X-Amzn-SageMaker-New-Session-Id"]
    assert re.fullmatch(r"[0-9a-f]{32}; Expires=\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", opened), opened
    return opened.split(";")[0]


async def test_a_body_is_served_as_the_request_it_is() -> None:
    async with (
        run_mock(block_size=16, speedup=50, events=False) as mock,
        httpx.AsyncClient(base_url=mock.base_url) as http,
    ):
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = await http.post("/invocations", json=chat)
        assert r.status_code == 200 and r.json()["object"] == "chat.completion"
        r = await http.post("/invocations", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["object"] == "text_completion"
        r = await http.post("/invocations", json={"model": MODEL, "input": "hi"})
        assert r.status_code == 200 and r.json()["object"] == "list"
        # a body with both is a chat request, as vLLM tries chat first
        r = await http.post("/invocations", json={**chat, "prompt": "ignored"})
        assert r.json()["object"] == "chat.completion"
        for body, field in (({"model": MODEL}, "body"), ([1], "body"), ({"requestType": "X"}, "requestType")):
            r = await http.post("/invocations", json=body)
            assert (r.status_code, r.json()["error"]["param"]) == (400, field), r.text


async def test_a_session_is_opened_used_closed_and_then_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    async with (
        run_mock(block_size=16, speedup=50, events=False) as mock,
        httpx.AsyncClient(base_url=mock.base_url) as http,
    ):
        session = await _open(http)
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = await http.post("/invocations", json=chat, headers={SESSION: session})
        assert r.status_code == 200, r.text
        r = await http.post("/invocations", json={"requestType": "CLOSE"}, headers={SESSION: session})
        assert r.status_code == 200
        assert r.headers["X-Amzn-SageMaker-Closed-Session-Id"] == session
        for body in (chat, {"requestType": "CLOSE"}):
            r = await http.post("/invocations", json=body, headers={SESSION: session})
            assert (r.status_code, r.json()["error"]["param"]) == (400, SESSION.lower())
        r = await http.post("/invocations", json={"requestType": "CLOSE"})
        assert (r.status_code, r.json()["error"]["param"]) == (400, SESSION.lower())
        # one that expires is gone as well
        monkeypatch.setattr(invocations, "SESSION_TTL_S", 0.0)
        expired = await _open(http)
        r = await http.post("/invocations", json=chat, headers={SESSION: expired})
        assert r.status_code == 400


async def test_the_model_is_sagemakers_adapter_header_or_the_served_one() -> None:
    """As vLLM's SageMaker handling does: the body's ``model`` counts for nothing; the adapter
    header's value takes its place (the mock serves none: a 404 naming ``model``)."""
    async with (
        run_mock(block_size=16, speedup=50, events=False) as mock,
        httpx.AsyncClient(base_url=mock.base_url) as http,
    ):
        chat = {"model": "another-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = await http.post("/invocations", json=chat)
        assert (r.status_code, r.json()["model"]) == (200, MODEL), r.text
        r = await http.post("/v1/chat/completions", json=chat)  # (elsewhere the body's model counts)
        assert (r.status_code, r.json()["error"]["param"]) == (404, "model")
        named = {"X-Amzn-SageMaker-Adapter-Identifier": "sql-lora"}
        r = await http.post("/invocations", json={**chat, "model": MODEL}, headers=named)
        assert (r.status_code, r.json()["error"]["param"]) == (404, "model"), r.text
        r = await http.post("/invocations", json=chat, headers={"X-Amzn-SageMaker-Adapter-Identifier": MODEL})
        assert r.status_code == 200, r.text
