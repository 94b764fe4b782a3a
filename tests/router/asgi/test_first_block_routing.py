"""A long prompt no worker holds is sent on its first block alone and tokenized once it is on its
way: over HTTP, through the standalone router to two simulated engines. The router still counts
its whole prompt where it went (the next request with that prefix follows it there), and a prompt
whose beginning some worker holds is tokenized before routing, as always."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator

import aiohttp
import pytest

from kvmesh.bench.session import words
from kvmesh.mock.testing import run_mock
from kvmesh.router.asgi.standalone import build_router_app
from kvmesh.router.core.kv_router import KvRouter
from kvmesh.router.mesh.settings import MeshSettings, WorkerSpec
from tests.router.servers import serve


async def _chat(http: aiohttp.ClientSession, url: str, model: str, system: str, question: str) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": 2,
        "nvext": {"extra_fields": ["worker_id"]},
    }
    async with http.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


@contextlib.asynccontextmanager
async def _engines(n: int, speedup: float) -> AsyncIterator[tuple[str, str]]:
    """``n`` simulated engines behind the standalone router: ``(router URL, model)``."""
    async with contextlib.AsyncExitStack() as stack:
        engines = [
            await stack.enter_async_context(run_mock(block_size=16, speedup=speedup)) for _ in range(n)
        ]
        workers = tuple(WorkerSpec(e.base_url, "abcdefgh"[i]) for i, e in enumerate(engines))
        front = await stack.enter_async_context(serve(build_router_app(MeshSettings(workers=workers))))
        yield front.url, engines[0].config.model


def _spy_amend(monkeypatch: pytest.MonkeyPatch) -> list[tuple[dict[str, object], bool]]:
    """Every ``KvRouter.amend`` call from now on: its keyword arguments and what it returned."""
    calls: list[tuple[dict[str, object], bool]] = []
    amend = KvRouter.amend

    def spied(self: KvRouter, *args: object, **kwargs: object) -> bool:
        calls.append((kwargs, amend(self, *args, **kwargs)))  # type: ignore[arg-type]
        return calls[-1][1]

    monkeypatch.setattr(KvRouter, "amend", spied)
    return calls


async def _state(http: aiohttp.ClientSession, url: str) -> dict:
    async with http.get(url + "/kvmesh/router") as r:
        return (await r.json())["routed_on_first_block"]


async def test_a_cold_prompt_is_routed_on_its_first_block_and_counted_whole_once_sent(
    http: aiohttp.ClientSession,
) -> None:
    rng = random.Random(3)
    async with _engines(2, 1000.0) as (url, model):
        documents = [f"Document {d}: " + words(rng, 1500) for d in range(3)]
        served = {}
        for d, document in enumerate(documents):
            answer = await _chat(http, url, model, document, "Summarise it.")
            served[d] = answer["nvext"]["worker_id"]
            assert answer["usage"]["prompt_tokens"] > 3000  # about 3.5k tokens, nothing cached
            assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        state = await _state(http, url)
        # three new documents: three prompts sent before they were tokenized, and the router
        # learned the bodies' tokens per byte from them
        assert state["prompts"] == 3
        assert 0.2 < state["tokens_per_byte"] < 0.4
        for d, document in enumerate(documents):
            # a second question on each document goes where its prefix is (the router counted
            # its blocks there after the first one was sent, and the engine has them now)
            answer = await _chat(http, url, model, document, "And in one line?")
            assert answer["nvext"]["worker_id"] == served[d]
            assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 3000
        # those prompts' beginnings were held: tokenized before routing, as ever
        assert (await _state(http, url))["prompts"] == 3


async def test_a_failure_counting_a_prompt_already_sent_does_not_drop_its_answer(
    http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*args: object, **kwargs: object) -> bool:
        raise RuntimeError("a bug in the bookkeeping")

    monkeypatch.setattr(KvRouter, "amend", broken)
    rng = random.Random(4)
    async with _engines(1, 1000.0) as (url, model):
        answer = await _chat(http, url, model, "Notes: " + words(rng, 900), "Go on.")
    assert answer["choices"][0]["message"]["content"]
    assert "counting a prompt routed before it was tokenized failed" in caplog.text


async def test_a_prompt_counted_once_sent_keeps_its_own_cache_credit(
    http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    # nvext.agent_hints.kv_overlap_score_credit weighed the request's decision; counting its whole prompt
    # afterwards must weigh it the same, not by the router's default
    calls = _spy_amend(monkeypatch)
    rng = random.Random(5)
    async with _engines(1, 1000.0) as (url, model):
        for credit in (0.0, 0.5, None):
            body = {
                "model": model,
                "messages": [{"role": "user", "content": f"Notes {credit}: " + words(rng, 900)}],
                "max_tokens": 2,
                "nvext": {} if credit is None else {"agent_hints": {"kv_overlap_score_credit": credit}},
            }
            async with http.post(url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
    assert [kwargs.get("overlap_score_credit") for kwargs, _ in calls] == [0.0, 0.5, None]


async def test_a_cold_prompt_sent_is_counted_before_a_request_that_begins_like_it_is_routed(
    http: aiohttp.ClientSession,
) -> None:
    # A cold prompt is counted a while after it is sent (the engine reads it meanwhile), but a
    # request sharing its first block (a sibling sent with it) has it counted first: it is then
    # tokenized, routed on all its blocks and sent beside it, not routed cold elsewhere.
    rng = random.Random(6)
    async with _engines(2, 1.0) as (url, model):
        # warm connections to both engines: a request goes from its decision to its write at once
        for warm in range(4):
            await _chat(http, url, model, f"Warm-up {warm}.", "Hi.")
        context = "Shared context: " + words(rng, 1500)
        answers = await asyncio.gather(
            *(_chat(http, url, model, context, f"Question {q}?") for q in range(3))
        )
        assert answers[1]["nvext"]["worker_id"] == answers[0]["nvext"]["worker_id"]
        assert answers[2]["nvext"]["worker_id"] == answers[0]["nvext"]["worker_id"]
        # only the first was sent before it was tokenized
        assert (await _state(http, url))["prompts"] == 1


async def test_a_cold_prompt_answered_before_its_count_was_due_is_counted_before_its_first_token(
    http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An engine that answers far sooner than the router predicts: the count, due midway to the
    # predicted first token, runs when the first token comes instead, while it still counts
    # (KvRouter.amend is a no-op once the first token is in).
    calls = _spy_amend(monkeypatch)
    rng = random.Random(7)
    async with _engines(1, 1000.0) as (url, model):
        for d in range(3):
            await _chat(http, url, model, f"Report {d}: " + words(rng, 1500), "Summarise.")
    assert [counted for _, counted in calls] == [True, True, True]
