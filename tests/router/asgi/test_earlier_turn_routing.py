"""A conversation's later turn is routed on its earlier turn's blocks, found by its messages, and
tokenized once it is on its way: over HTTP, through the standalone router to two simulated
engines. The router checks the blocks against the prompt's own once it has them; a chat template
that does not render a conversation turn by turn stops it, and later turns are tokenized first."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest

from kvmesh.bench.session import words
from kvmesh.mock.testing import run_mock
from kvmesh.router.asgi.standalone import build_router_app
from kvmesh.router.mesh.settings import MeshSettings, WorkerSpec
from kvmesh.router.request.tokenizer import BuiltinTokenizer
from tests.router.fleet import indexed
from tests.router.servers import serve

TOKEN = {"x-kvmesh-admin-token": "s3cret"}
THINK = 0.25
"""Seconds between an answer and the next turn: a client's think time, steady, so that the router's
learned gap between turns (and the conversations it expires by it) is this one. Long enough that
the rest of a gap (the answer, waiting for its blocks to be indexed) cannot make one gap four times
another on a loaded machine: the router would end the conversation there (a CI run with 0.05 s
read turn 2 where 4 was sent)."""


async def _chat(http: aiohttp.ClientSession, url: str, model: str, messages: list[dict[str, Any]]) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": 40, "nvext": {"extra_fields": ["worker_id"]}}
    async with http.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def _router(http: aiohttp.ClientSession, url: str) -> dict:
    async with http.get(url + "/kvmesh/router", headers=TOKEN) as r:
        return await r.json()


async def _lengths(http: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    """(count, sum) of the prompt lengths the router has observed (``/metrics``)."""
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    values = {}
    for line in text.splitlines():
        if line.startswith(("kvmesh_input_sequence_tokens_count", "kvmesh_input_sequence_tokens_sum")):
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0]] = float(value)
    return values["kvmesh_input_sequence_tokens_count"], values["kvmesh_input_sequence_tokens_sum"]


async def _indexed(http: aiohttp.ClientSession, url: str, answer: dict[str, Any]) -> None:
    """Wait until the engine's KV events for ``answer``'s prompt and the answer itself (its last
    token is never computed) reach the router's index (they do within a think time; these engines
    answer in a millisecond)."""
    worker = answer["nvext"]["worker_id"]["decode_worker_id"]
    usage = answer["usage"]
    blocks = (usage["prompt_tokens"] + usage["completion_tokens"] - 1) // 16
    await indexed(http, url, worker, blocks, TOKEN, tries=250)


class _Recording(BuiltinTokenizer):
    """The router's tokenizer, telling ``note`` of every chat prompt it renders whole (a front
    handed it tokenizes with it alone; the engines have their own)."""

    def __init__(self, note: Callable[[list[dict[str, Any]], list[int]], None]) -> None:
        super().__init__()
        self.note = note

    def apply_chat_template(self, messages: list[dict[str, Any]], **kw: Any) -> list[int]:
        ids = super().apply_chat_template(messages, **kw)
        self.note(messages, ids)
        return ids


@contextlib.asynccontextmanager
async def _fleet(tokenizer: BuiltinTokenizer | None = None) -> AsyncIterator[tuple[str, str]]:
    """A standalone front over two fast simulated engines: its URL, and their model's name."""
    async with run_mock(block_size=16, speedup=1000.0) as a, run_mock(block_size=16, speedup=1000.0) as b:
        settings = MeshSettings(
            workers=(WorkerSpec(a.base_url, "a"), WorkerSpec(b.base_url, "b")),
            admin_token="s3cret",
            tokenizer="builtin" if tokenizer is None else "engine",  # ("engine": the one handed to it)
        )
        async with serve(build_router_app(settings, tokenizer=tokenizer)) as front:
            yield front.url, a.config.model


def _opening(rng: random.Random, agent: int, system_words: int) -> list[dict[str, Any]]:
    """An agent's first request: a long system prompt and a short task."""
    return [
        {"role": "system", "content": f"You are agent {agent}. " + words(rng, system_words)},
        {"role": "user", "content": "Task: " + words(rng, 20)},
    ]


async def _converse(
    http: aiohttp.ClientSession, url: str, model: str, turns: int, seed: int
) -> list[dict[str, Any]]:
    """One conversation of ``turns`` turns, each answer sent back with a long tool output."""
    rng = random.Random(seed)
    messages = _opening(rng, 1, 400)
    answers = []
    for _ in range(turns):
        answer = await _chat(http, url, model, messages)
        answers.append(answer)
        await asyncio.sleep(THINK)
        await _indexed(http, url, answer)
        messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
        messages.append({"role": "user", "content": "Tool result: " + words(rng, 300)})
    return answers


async def _four_turns(http: aiohttp.ClientSession, seed: int) -> tuple[list[dict], dict, list[dict]]:
    """A conversation of four turns through a front of two engines: the answers, the front's
    ``/kvmesh/router`` and its decisions, oldest first."""
    async with _fleet() as (url, model):
        answers = await _converse(http, url, model, 4, seed=seed)
        state = await _router(http, url)
        async with http.get(url + "/kvmesh/decisions?limit=4", headers=TOKEN) as r:
            decisions = (await r.json())["decisions"][::-1]
    return answers, state, decisions


async def test_later_turns_are_routed_on_their_earlier_turn_s_blocks_and_counted_whole(
    http: aiohttp.ClientSession,
) -> None:
    answers, state, decisions = await _four_turns(http, seed=5)
    # every later turn was found by its messages, and none of them began otherwise
    assert state["routed_on_earlier_turn"]["found"] == 3
    assert state["routed_on_earlier_turn"]["stopped"] is None
    # each later turn was decided with the turn before it whole where that turn went: its full
    # blocks cached there, then the blocks its answer was decoded into (the later prompt repeats
    # the answer), and the new messages' tokens estimated (no prompt was known yet)
    for before, answer, decision in zip(answers[:-1], answers[1:], decisions[1:], strict=True):
        went = before["nvext"]["worker_id"]["decode_worker_id"]
        home = next(c for c in decision["candidates"] if c["worker_id"] == went)
        assert home["overlap_blocks"] > before["usage"]["prompt_tokens"] // 16
        assert home["overlap_blocks"] <= answer["usage"]["prompt_tokens"] // 16
        assert home["prefill_tokens"] > 0
        assert answer["usage"]["prompt_tokens"] > before["usage"]["prompt_tokens"]
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
    answers, state, _ = await _four_turns(http, seed=6)
    assert all(answer["choices"][0]["message"]["content"] for answer in answers)  # all answered
    memo = state["routed_on_earlier_turn"]
    # the second turn was routed on the first's blocks and did not begin with them: the memo
    # stopped there, and the turns after it were tokenized before they were routed
    assert memo["found"] == 1
    assert memo["stopped"] is not None and memo["kept"] == 0
    assert "does not render conversations turn by turn" in caplog.text


async def test_the_same_messages_again_are_not_tokenized_or_counted_again_once_sent(
    http: aiohttp.ClientSession,
) -> None:
    # best-of-n sent one after another (a retry reads the same): the first is tokenized once it is
    # on its way; the others have its blocks and length as their own and are never tokenized
    rendered: list[int] = []
    messages = _opening(random.Random(7), 2, 300)
    async with _fleet(_Recording(lambda _, ids: rendered.append(len(ids)))) as (url, model):
        before = await _lengths(http, url)
        answers = [await _chat(http, url, model, messages)]
        await _indexed(http, url, answers[0])
        answers += [await _chat(http, url, model, messages) for _ in range(2)]
        state = await _router(http, url)
        after = await _lengths(http, url)
        async with http.get(url + "/kvmesh/decisions?limit=3", headers=TOKEN) as r:
            decisions = (await r.json())["decisions"][::-1]
    prompt = answers[0]["usage"]["prompt_tokens"]
    assert all(answer["usage"]["prompt_tokens"] == prompt for answer in answers)
    assert rendered == [prompt]  # the first one's, once it was sent; none for the other two
    # each is still a request of its length in the lengths the router has seen
    assert (after[0] - before[0], after[1] - before[1]) == (3, 3 * prompt)
    memo = state["routed_on_earlier_turn"]
    assert memo["same"] == 2 and memo["found"] == 2 and memo["stopped"] is None
    # each repeat was decided on all of its full blocks: where the first went, all are cached
    went = answers[0]["nvext"]["worker_id"]["decode_worker_id"]
    for decision in decisions[1:]:
        home = next(c for c in decision["candidates"] if c["worker_id"] == went)
        assert home["overlap_blocks"] == prompt // 16


async def _raw_post(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> dict[str, Any]:
    """The JSON answer to the request already written on this connection (read to its end)."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = head.split(b" ", 2)[1]
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    body = await reader.readexactly(length)
    writer.close()
    assert status == b"200", body
    return json.loads(body)


async def _together(url: str, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The answers to chat requests that reach the front in one read of its sockets: written on
    connections it has already accepted, one after another without a pause between them."""
    port = int(url.rsplit(":", 1)[1])
    connections = [await asyncio.open_connection("127.0.0.1", port) for _ in bodies]
    await asyncio.sleep(0.05)  # (accepted by the front)
    for (_, writer), body in zip(connections, bodies, strict=True):
        data = json.dumps(body).encode()
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: kvmesh\r\ncontent-type: application/json\r\n"
            + f"content-length: {len(data)}\r\n\r\n".encode()
            + data
        )
    return list(await asyncio.gather(*(_raw_post(reader, writer) for reader, writer in connections)))


async def test_a_burst_of_later_turns_is_routed_before_any_of_them_is_tokenized(
    http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    # parallel tool calls: one conversation's next turn three times, each with its own tool result,
    # reaching the front together. Each is routed on the earlier turn's blocks; the front routes
    # and sends all three before it works out their tokens, so none of them waits for another's
    # tokenizing. (Counting each one right after sending it made the second wait for the first's
    # tokens, the third for both.)
    from kvmesh.router.asgi.routed import RoutedRequest

    events: list[str] = []
    route = RoutedRequest.route
    rendering = False  # (the first turn's renders are not the burst's)

    def routing(self: RoutedRequest, *args: Any, **kw: Any) -> Any:
        events.append("route")
        return route(self, *args, **kw)

    def rendered(messages: list[dict[str, Any]], _: list[int]) -> None:
        if rendering:
            events.append("tokenize " + messages[-1]["content"][:13])

    rng = random.Random(8)
    messages = _opening(rng, 3, 400)
    async with _fleet(_Recording(rendered)) as (url, model):
        first = await _chat(http, url, model, messages)
        await _indexed(http, url, first)
        history = [*messages, {"role": "assistant", "content": first["choices"][0]["message"]["content"]}]
        calls = [{"role": "user", "content": f"Tool result {i}: " + words(rng, 200)} for i in range(3)]
        monkeypatch.setattr(RoutedRequest, "route", routing)
        rendering = True
        answers = await _together(
            url, [{"model": model, "messages": [*history, call], "max_tokens": 8} for call in calls]
        )
        state = await _router(http, url)
    assert all(answer["choices"][0]["message"]["content"] for answer in answers)
    assert state["routed_on_earlier_turn"]["found"] == 3  # all three on the earlier turn's blocks
    assert state["routed_on_earlier_turn"]["stopped"] is None  # each began with them, once tokenized
    assert events[:3] == ["route"] * 3, events
    assert sorted(events[3:]) == [
        "tokenize Tool result 0",
        "tokenize Tool result 1",
        "tokenize Tool result 2",
    ]
    # and each was counted whole where it went, as one conversation's turn: the later turns' tips
    assert state["conversations"]["deepest_turn"] == 2


async def test_the_same_later_turn_sent_together_is_counted_once_and_routed_whole(
    http: aiohttp.ClientSession,
) -> None:
    # best-of-n at a conversation's next turn: three copies of one request reach the front together.
    # The first is routed on the earlier turn's blocks and counted after the requests waiting; its
    # copies, which have its messages, count it first and are routed on all of its blocks as their
    # own, never tokenized themselves.
    rendered: list[int] = []
    counting = False  # (the first turn's renders are not the copies')

    def rendering(_: list[dict[str, Any]], ids: list[int]) -> None:
        if counting:
            rendered.append(len(ids))

    rng = random.Random(9)
    messages = _opening(rng, 4, 400)
    async with _fleet(_Recording(rendering)) as (url, model):
        first = await _chat(http, url, model, messages)
        await _indexed(http, url, first)
        history = [
            *messages,
            {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
            {"role": "user", "content": "Tool result: " + words(rng, 200)},
        ]
        counting = True
        answers = await _together(url, [{"model": model, "messages": history, "max_tokens": 8}] * 3)
        state = await _router(http, url)
    prompt = answers[0]["usage"]["prompt_tokens"]
    assert all(answer["usage"]["prompt_tokens"] == prompt for answer in answers)
    assert rendered == [prompt]  # the first one's alone
    memo = state["routed_on_earlier_turn"]
    assert memo["found"] == 3 and memo["same"] == 2 and memo["stopped"] is None
