"""A conversation's later turn is routed on its earlier turn's blocks, found by its messages, and
tokenized once it is on its way: over HTTP, through the standalone router to two simulated
engines. The router checks the blocks against the prompt's own once it has them; a chat template
that does not render a conversation turn by turn stops it, and later turns are tokenized first."""

from __future__ import annotations

import itertools
import random
from typing import Any

import aiohttp
import pytest

from kvmesh.bench.session import words
from kvmesh.mock.testing import run_mock
from kvmesh.router.asgi.standalone import build_router_app
from kvmesh.router.mesh.settings import MeshSettings, WorkerSpec
from kvmesh.router.request.tokenizer import BuiltinTokenizer
from tests.router.servers import serve


async def _chat(http: aiohttp.ClientSession, url: str, model: str, messages: list[dict[str, Any]]) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": 8, "nvext": {"extra_fields": ["worker_id"]}}
    async with http.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def _router(http: aiohttp.ClientSession, url: str) -> dict:
    async with http.get(url + "/kvmesh/router") as r:
        return await r.json()


async def _converse(
    http: aiohttp.ClientSession, url: str, model: str, turns: int, seed: int
) -> list[dict[str, Any]]:
    """One conversation of ``turns`` turns, each answer sent back with a long tool output."""
    rng = random.Random(seed)
    messages = [
        {"role": "system", "content": "You are agent 1. " + words(rng, 400)},
        {"role": "user", "content": "Task: " + words(rng, 20)},
    ]
    answers = []
    for _ in range(turns):
        answer = await _chat(http, url, model, messages)
        answers.append(answer)
        messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
        messages.append({"role": "user", "content": "Tool result: " + words(rng, 300)})
    return answers


async def test_later_turns_are_routed_on_their_earlier_turn_s_blocks_and_go_home(
    http: aiohttp.ClientSession,
) -> None:
    async with run_mock(block_size=16, speedup=1000.0) as a, run_mock(block_size=16, speedup=1000.0) as b:
        settings = MeshSettings(workers=(WorkerSpec(a.base_url, "a"), WorkerSpec(b.base_url, "b")))
        async with serve(build_router_app(settings)) as front:
            answers = await _converse(http, front.url, a.config.model, 4, seed=5)
            state = await _router(http, front.url)
    # every later turn was found by its messages, and none of them began otherwise
    assert state["routed_on_earlier_turn"]["found"] == 3
    assert state["routed_on_earlier_turn"]["stopped"] is None
    # each went where its history was: the engine served it from its cache
    assert len({answer["nvext"]["worker_id"]["decode_worker_id"] for answer in answers}) == 1
    for before, answer in itertools.pairwise(answers):
        cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= before["usage"]["prompt_tokens"] // 16 * 16 - 16
    # counted whole once sent: the conversation stands at its fourth turn, as one conversation
    conversations = state["conversations"]
    assert conversations["deepest_turn"] == 4 and conversations["live"] == 1


async def test_a_template_that_does_not_render_turn_by_turn_stops_it(
    http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # a template that writes something about the whole conversation at its start (here, as
    # many start tokens as there are messages): no earlier prompt begins a later one
    plain = BuiltinTokenizer.apply_chat_template

    def counting(self: BuiltinTokenizer, messages: list[dict[str, Any]], **kw: Any) -> list[int]:
        ids = plain(self, messages, **kw)
        return [ids[0]] * len(messages) + ids

    monkeypatch.setattr(BuiltinTokenizer, "apply_chat_template", counting)
    async with run_mock(block_size=16, speedup=1000.0) as a, run_mock(block_size=16, speedup=1000.0) as b:
        settings = MeshSettings(workers=(WorkerSpec(a.base_url, "a"), WorkerSpec(b.base_url, "b")))
        async with serve(build_router_app(settings)) as front:
            answers = await _converse(http, front.url, a.config.model, 4, seed=6)
            state = await _router(http, front.url)
    assert all(answer["choices"][0]["message"]["content"] for answer in answers)  # all answered
    memo = state["routed_on_earlier_turn"]
    # the second turn was routed on the first's blocks and did not begin with them: the memo
    # stopped there, and the turns after it were tokenized before they were routed
    assert memo["found"] == 1
    assert memo["stopped"] is not None and memo["kept"] == 0
    assert "does not render conversations turn by turn" in caplog.text
