"""SGLang's ``POST /abort_request`` on the mock, and the ``rid`` it names requests by (``/generate``,
``/v1/chat/completions``, ``/v1/completions``), driven over HTTP on loopback.

As SGLang 0.5.23 has it: an abort by ``rid`` stops the request with that rid and every one whose
rid begins with it (none when no request has the rid itself); ``abort_all`` stops every request the
engine has; the answer is 200 with an empty body either way. The aborted request is answered, not
cut off: its tokens so far and the abort as its finish reason, a stream's last event before
``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from kvmesh.mock.engine import MockEngine
from kvmesh.mock.testing import run_mock
from tests.mock.test_generate import TEXT
from tests.mock.test_server import metric, wait_idle
from tests.mock.test_tokens_api import _data

pytestmark = pytest.mark.e2e

BS = 16
LONG = 1500
GENERATE = {"max_new_tokens": LONG, "ignore_eos": True}
"""``sampling_params`` of a ``/generate`` request that runs until it is stopped."""
OPENAI = {"max_tokens": LONG, "ignore_eos": True}
CHAT = [{"role": "user", "content": "Tell me a long story."}]
ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
"""``meta_info.finish_reason`` of a running ``/generate`` request stopped by ``/abort_request``."""


async def _until(engine: MockEngine, running: int, waiting: int = 0) -> None:
    """Until the engine runs ``running`` requests (choices) and queues ``waiting``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while engine.scheduler.num_running != running or engine.scheduler.num_waiting != waiting:
        assert loop.time() < deadline, "the requests did not reach the engine"
        await asyncio.sleep(0.005)


async def _a_step_later(engine: MockEngine) -> None:
    """Until the engine has ended one more step: every request it runs has made a token."""
    start = engine.steps
    while engine.steps == start:
        await asyncio.sleep(0.005)


async def _abort(http: httpx.AsyncClient, body: Any) -> None:
    r = await http.post("/abort_request", json=body)
    assert r.status_code == 200 and r.content == b"", r.text


def _mock(**overrides: Any) -> Any:
    return run_mock(block_size=BS, num_blocks=256, speedup=5, **overrides)


async def test_an_abort_by_rid_ends_a_generate_stream_with_the_abort_then_done() -> None:
    async with _mock() as mock, httpx.AsyncClient(base_url=mock.base_url, timeout=30) as http:
        engine = mock.engine
        body = {"text": TEXT, "rid": "long", "sampling_params": GENERATE, "stream": True}
        async with http.stream("POST", "/generate", json=body) as r:
            lines = r.aiter_lines()
            [first] = await _data(lines, first_only=True)
            assert first["meta_info"]["finish_reason"] is None
            await _abort(http, {"rid": "long"})
            assert engine.scheduler.num_running == 0  # (stopped in the engine, its blocks freed)
            rest = await _data(lines)
        assert rest[-1] == "[DONE]"
        *between, last = [first, *rest[:-1]]
        assert all(e["meta_info"]["finish_reason"] is None for e in between)
        meta = last["meta_info"]
        assert meta["id"] == "long" and meta["finish_reason"] == ABORTED
        assert meta["completion_tokens"] == len(last["output_ids"]) < LONG // 2
        assert meta["e2e_latency"] > 0
        await wait_idle(engine)
        assert engine.pool.num_used == 0
        text = (await http.get("/metrics")).text
        assert metric(text, 'vllm:request_success_total{finished_reason="abort",') == 1


async def test_an_aborted_whole_generate_answer_carries_the_tokens_so_far() -> None:
    async with (
        _mock(max_num_seqs=1) as mock,
        httpx.AsyncClient(base_url=mock.base_url, timeout=30) as http,
    ):
        engine = mock.engine
        running = asyncio.create_task(
            http.post("/generate", json={"text": TEXT, "rid": "run", "sampling_params": GENERATE})
        )
        await _until(engine, 1)
        await _a_step_later(engine)
        queued = asyncio.create_task(
            http.post("/generate", json={"input_ids": [5] * 20, "rid": "queue", "sampling_params": GENERATE})
        )
        await _until(engine, 1, waiting=1)

        # A request still queued: SGLang takes it out of its queue, with nothing made.
        await _abort(http, {"rid": "queue", "abort_message": "taken and ignored"})
        r = await queued
        assert r.status_code == 200, r.text
        answer = r.json()
        assert answer["output_ids"] == [] and answer["meta_info"]["completion_tokens"] == 0
        assert answer["meta_info"]["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}

        await _abort(http, {"rid": "run"})
        assert engine.scheduler.num_running == 0
        r = await running
        assert r.status_code == 200, r.text
        answer = r.json()
        meta = answer["meta_info"]
        assert meta["id"] == "run" and meta["finish_reason"] == ABORTED
        assert 0 < meta["completion_tokens"] == len(answer["output_ids"]) < LONG // 2
        await wait_idle(engine)
        assert engine.pool.num_used == 0


async def test_an_abort_by_rid_ends_every_choice_of_a_chat_stream_and_a_completion() -> None:
    async with _mock() as mock, httpx.AsyncClient(base_url=mock.base_url, timeout=30) as http:
        engine = mock.engine
        body = {
            "messages": CHAT,
            "rid": "chat-1",
            "n": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
            **OPENAI,
        }
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = r.aiter_lines()
            first = await _data(lines, first_only=True)
            await _until(engine, 2)
            await _abort(http, {"rid": "chat-1"})  # (n = 2: both choices are the request's)
            assert engine.scheduler.num_running == 0
            rest = await _data(lines)
        assert rest[-1] == "[DONE]"
        *chunks, usage_event = [*first, *rest[:-1]]
        reasons: dict[int, list[str | None]] = {0: [], 1: []}
        for chunk in chunks:
            [choice] = chunk["choices"]
            reasons[choice["index"]].append(choice["finish_reason"])
        for said in reasons.values():  # (each choice's last chunk says so, none before it)
            assert said[-1] == "abort" and set(said[:-1]) == {None}
        assert usage_event["choices"] == [] and usage_event["usage"]["completion_tokens"] < LONG

        # A whole completion: 200, its text so far, the abort as its finish reason.
        waiting = asyncio.create_task(
            http.post("/v1/completions", json={"prompt": "Once upon a time", "rid": "cmpl-1", **OPENAI})
        )
        await _until(engine, 1)
        await _a_step_later(engine)
        await _abort(http, {"rid": "cmpl-1"})
        r = await waiting
        assert r.status_code == 200, r.text
        answer = r.json()
        [choice] = answer["choices"]
        assert choice["finish_reason"] == "abort" and choice["text"]
        assert 0 < answer["usage"]["completion_tokens"] < LONG // 2
        await wait_idle(engine)
        assert engine.pool.num_used == 0


async def test_an_abort_stops_the_rid_and_the_longer_ones_it_begins_only() -> None:
    async with _mock() as mock, httpx.AsyncClient(base_url=mock.base_url, timeout=30) as http:
        engine = mock.engine
        tasks = {
            "job": http.post("/generate", json={"text": TEXT, "rid": "job", "sampling_params": GENERATE}),
            "job-2": http.post("/v1/chat/completions", json={"messages": CHAT, "rid": "job-2", **OPENAI}),
            "jobs": http.post("/v1/completions", json={"prompt": "x", "rid": "jobs", **OPENAI}),
            "other": http.post("/generate", json={"text": TEXT, "rid": "other", "sampling_params": GENERATE}),
        }
        running = {rid: asyncio.create_task(request) for rid, request in tasks.items()}
        await _until(engine, 4)

        # No request has "jo" itself: SGLang drops the abort, though three rids begin with it.
        await _abort(http, {"rid": "jo"})
        assert engine.scheduler.num_running == 4

        # "job" names itself and the rids that begin with it; "other" runs on.
        await _abort(http, {"rid": "job"})
        assert engine.scheduler.num_running == 1
        job = (await running["job"]).json()
        assert job["meta_info"]["finish_reason"] == ABORTED
        for rid in ("job-2", "jobs"):
            answer = (await running[rid]).json()
            assert answer["choices"][0]["finish_reason"] == "abort"
        assert not running["other"].done()

        await _abort(http, {"rid": "job"})  # (again: it ended, nothing is left to stop)
        assert engine.scheduler.num_running == 1
        await _abort(http, {"rid": "other"})
        other = (await running["other"]).json()
        assert other["meta_info"]["finish_reason"] == ABORTED
        await wait_idle(engine)
        assert engine.pool.num_used == 0


async def test_abort_all_stops_the_requests_of_every_api() -> None:
    async with _mock() as mock, httpx.AsyncClient(base_url=mock.base_url, timeout=30) as http:
        engine = mock.engine
        chat = asyncio.create_task(http.post("/v1/chat/completions", json={"messages": CHAT, **OPENAI}))
        tokens = asyncio.create_task(
            http.post(
                "/inference/v1/generate",
                json={"token_ids": [9] * 30, "sampling_params": OPENAI},
            )
        )
        generate = {"text": TEXT, "sampling_params": GENERATE, "stream": True}
        async with http.stream("POST", "/generate", json=generate) as r:
            lines = r.aiter_lines()
            await _data(lines, first_only=True)
            completion = {"prompt": "x", "stream": True, **OPENAI}
            async with http.stream("POST", "/v1/completions", json=completion) as c:
                completion_lines = c.aiter_lines()
                await _data(completion_lines, first_only=True)
                await _until(engine, 4)
                await _abort(http, {"abort_all": True})
                assert engine.scheduler.num_running == 0
                completed = await _data(completion_lines)
            rest = await _data(lines)
        assert rest[-1] == "[DONE]" and rest[-2]["meta_info"]["finish_reason"] == ABORTED
        assert completed[-1] == "[DONE]" and completed[-2]["choices"][0]["finish_reason"] == "abort"
        assert (await chat).json()["choices"][0]["finish_reason"] == "abort"
        assert (await tokens).json()["choices"][0]["finish_reason"] == "abort"
        await wait_idle(engine)
        assert engine.pool.num_used == 0
        text = (await http.get("/metrics")).text
        assert metric(text, 'vllm:request_success_total{finished_reason="abort",') == 4


async def test_an_abort_that_names_no_running_request_stops_nothing() -> None:
    async with _mock() as mock, httpx.AsyncClient(base_url=mock.base_url, timeout=30) as http:
        engine = mock.engine
        named = asyncio.create_task(
            http.post("/generate", json={"text": TEXT, "rid": "named", "sampling_params": GENERATE})
        )
        await _until(engine, 1)
        for body in (
            {"rid": "unknown"},
            {"rid": "named-longer"},
            {"rid": ""},  # (an empty rid would begin every one: SGLang drops it)
            {"rid": None, "abort_all": False},
            {},
        ):
            await _abort(http, body)
            assert engine.scheduler.num_running == 1, body

        # An abort by rid never reaches a request without one: it runs to its end.
        unnamed = asyncio.create_task(
            http.post("/generate", json={"text": TEXT, "sampling_params": {"max_new_tokens": 400}})
        )
        await _until(engine, 2)
        await _abort(http, {"rid": "named"})
        assert engine.scheduler.num_running == 1
        assert (await named).json()["meta_info"]["finish_reason"] == ABORTED
        answer = (await unnamed).json()
        assert answer["meta_info"]["finish_reason"] == {"type": "length", "length": 400}
        await wait_idle(engine)
        assert engine.pool.num_used == 0


@pytest.mark.parametrize(
    ("body", "field"),
    [
        pytest.param([{"rid": "a"}], "body", id="not-an-object"),
        pytest.param({"rid": 5}, "rid", id="rid-number"),
        pytest.param({"rid": ["a", "b"]}, "rid", id="rid-list"),
        pytest.param({"rid": "a", "abort_all": "yes"}, "abort_all", id="abort-all-string"),
        pytest.param({"abort_all": 1}, "abort_all", id="abort-all-number"),
    ],
)
async def test_an_abort_body_sglang_refuses_is_a_400_naming_the_field(body: Any, field: str) -> None:
    async with run_mock(speedup=20) as mock, httpx.AsyncClient(base_url=mock.base_url) as http:
        r = await http.post("/abort_request", json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field
        bad = await http.post("/abort_request", content=b"{not json")
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "body"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        pytest.param("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2}, id="chat"),
        pytest.param("/v1/completions", {"prompt": "x", "max_tokens": 2}, id="completions"),
        pytest.param("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2}}, id="generate"),
    ],
)
async def test_a_rid_that_is_not_one_string_is_a_400_naming_it(path: str, body: dict[str, Any]) -> None:
    async with run_mock(speedup=20) as mock, httpx.AsyncClient(base_url=mock.base_url) as http:
        for rid in (["a", "b"], 5, {"id": "a"}):  # (a list is a batch's)
            r = await http.post(path, json={**body, "rid": rid})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "rid"
        for rid in ("one", "", None):
            ok = await http.post(path, json={**body, "rid": rid})
            assert ok.status_code == 200, ok.text
