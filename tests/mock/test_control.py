"""The engine control of an RL loop on the mock, driven over HTTP on loopback: vLLM 0.33's
``/pause``, ``/resume``, ``/is_paused``, ``/sleep``, ``/wake_up``, ``/is_sleeping`` (dev mode) and
SGLang 0.5.23's ``/pause_generation`` and ``/continue_generation`` (kvmesh.mock.control).

Progress is read as tokens and steps (``/metrics``, the engine's own counts), never as time: a
frozen request is one whose token count does not move while the engine would have run many steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from kvmesh.events.subscriber import EventSubscriber
from kvmesh.events.wire import AllBlocksCleared, EventBatch
from kvmesh.mock.block_pool import BlockPool
from kvmesh.mock.engine import MockEngine
from kvmesh.mock.request import RequestStatus
from kvmesh.mock.scheduler import Pause, Scheduler
from kvmesh.mock.testing import RunningMock, run_mock
from kvmesh.router.asgi.forwarding import refused_for_now
from tests.mock.test_generate import TEXT
from tests.mock.test_scheduler import make
from tests.mock.test_server import metric
from tests.mock.test_sglang_abort import _until
from tests.mock.test_tokens_api import _data

pytestmark = pytest.mark.e2e

BS = 16
LONG = 1500
"""``max_tokens`` of a request that runs until it is stopped (or for a good many steps)."""
PROMPT = [1000 + i for i in range(4 * BS + 3)]
"""A prompt of four full blocks (and a few tokens more): a repeat of it reads 64 cached tokens."""
STEPS = 200
"""Steps the engine would have run, had it not been paused, before a frozen count is read again."""
AWAKE = {"is_paused": False, "is_sleeping": False}
PAUSED = {"is_paused": True, "is_sleeping": True}


def _mock(**overrides: Any) -> Any:
    return run_mock(**{"block_size": BS, "num_blocks": 256, "speedup": 50, **overrides})


@contextlib.asynccontextmanager
async def _serving(**overrides: Any) -> AsyncIterator[tuple[RunningMock, httpx.AsyncClient]]:
    async with _mock(**overrides) as mock, httpx.AsyncClient(base_url=mock.base_url, timeout=30) as http:
        yield mock, http


def _long(stream: bool = True, **extra: Any) -> dict[str, Any]:
    body = {"prompt": TEXT, "max_tokens": LONG, "ignore_eos": True, "stream": stream, **extra}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def _state(http: httpx.AsyncClient) -> dict[str, bool]:
    paused = (await http.get("/is_paused")).json()
    sleeping = (await http.get("/is_sleeping")).json()
    return {**paused, **sleeping}


async def _counts(http: httpx.AsyncClient) -> dict[str, float]:
    text = (await http.get("/metrics")).text
    return {
        "running": metric(text, "vllm:num_requests_running{"),
        "waiting": metric(text, "vllm:num_requests_waiting{"),
        "tokens": metric(text, "vllm:generation_tokens_total{"),
        "steps": metric(text, "kvmesh_mock_steps_total{"),
    }


async def _held_for_steps(engine: MockEngine) -> None:
    """As long as the engine would take to run :data:`STEPS` decode steps (asserting it runs none)."""
    before = engine.steps
    await asyncio.sleep(STEPS * 0.006 / engine.config.speedup)
    assert engine.steps == before


async def _complete(http: httpx.AsyncClient, prompt: list[int] = PROMPT, **extra: Any) -> httpx.Response:
    return await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, **extra})


async def _cached(http: httpx.AsyncClient) -> int:
    r = await _complete(http)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]  # type: ignore[no-any-return]


async def _post(http: httpx.AsyncClient, path: str, answer: dict[str, Any], **kw: Any) -> None:
    r = await http.post(path, **kw)
    assert r.status_code == 200, r.text
    assert r.json() == answer


def _assert_refused(r: httpx.Response) -> None:
    """A refusal for now: a 503, or, for a streamed chat request or completion, vLLM's 200 stream
    whose first event is the error (code 503) and then [DONE]."""
    if r.headers["content-type"].startswith("text/event-stream"):
        assert r.status_code == 200, r.text
        first, done, *rest = (e for e in r.text.split("\n\n") if e)
        assert (done, rest) == ("data: [DONE]", [])
        error = json.loads(first.removeprefix("data: "))["error"]
        assert error["type"] == "InternalServerError" and error["code"] == 503 and error["message"]
        assert refused_for_now(r.status_code, r.content)  # (the router routes around it)
        return
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert error["type"] == "ServiceUnavailableError" and error["code"] == 503 and error["message"]


def _finish_and_usage(events: list[Any]) -> tuple[str | None, int]:
    """A completions stream's finish reason and its completion tokens (its usage chunk)."""
    assert events[-1] == "[DONE]"
    finish = [c["choices"][0]["finish_reason"] for c in events[:-1] if c["choices"]]
    usage = events[-2]["usage"]
    return finish[-1], usage["completion_tokens"]


class _Cleared:
    """Counts the ``AllBlocksCleared`` events a subscriber of the mock's KV events receives."""

    def __init__(self, mock: RunningMock) -> None:
        assert mock.events_endpoint is not None
        self.count = 0
        self.subscriber = EventSubscriber(
            mock.events_endpoint, self._apply, replay_endpoint=mock.replay_endpoint, name="mock"
        )

    def _apply(self, seq: int, batch: EventBatch) -> None:
        self.count += sum(isinstance(event, AllBlocksCleared) for event in batch.events)

    async def caught_up(self, http: httpx.AsyncClient) -> int:
        """The count once every batch the engine published has arrived."""
        last_seq = (await http.get("/kvmesh/kv_state")).json()["ranks"][0]["last_seq"]
        expected = self.subscriber.expected_seq
        if expected is None or expected <= last_seq:
            # A subscriber that joined after the first batches went out, or missed the last ones,
            # sees no later batch to show it the gap (a router probes a quiet stream; this one
            # does not): it asks the engine's replay for the rest, from where it stands.
            self.subscriber.resume_from((expected or 0) - 1)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while self.subscriber.expected_seq != last_seq + 1:
            assert loop.time() < deadline, "the KV events did not arrive"
            await asyncio.sleep(0.01)
        return self.count


# --- the scheduler's pause -----------------------------------------------------------------------


def test_a_paused_scheduler_runs_what_its_pause_lets_through() -> None:
    sched = Scheduler(BlockPool(32, 4), max_num_seqs=4, max_num_batched_tokens=64)
    first, second = make(list(range(10)), 50), make(list(range(100, 110)), 50)
    sched.add_request(first)
    sched.update(sched.schedule())
    sched.add_request(second)
    sched.pause = Pause.NEW  # the running request goes on, the queued one stays queued
    assert sched.has_work
    out = sched.schedule()
    assert out.scheduled == [(first, 1)] and not out.admitted
    sched.update(out)
    sched.pause = Pause.ALL  # nothing runs
    assert not sched.has_work and sched.schedule().empty
    sched.pause = Pause.NONE
    assert [req for req, _ in sched.schedule().scheduled] == [first, second]


def test_retracted_requests_free_their_blocks_and_come_back_in_their_order() -> None:
    pool = BlockPool(32, 4)
    sched = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=64)
    reqs = [make(list(range(i * 100, i * 100 + 10)), 50) for i in range(3)]
    for req in reqs:
        sched.add_request(req)
    sched.update(sched.schedule())
    assert pool.num_used > 0
    assert sched.retract_running() == reqs[::-1]
    assert pool.num_used == 0 and sched.num_running == 0
    assert list(sched.waiting) == reqs and all(r.status is RequestStatus.PREEMPTED for r in reqs)
    assert [req for req, _ in sched.schedule().scheduled] == reqs  # (their prefixes read back)


# --- vLLM's /pause and /resume --------------------------------------------------------------------


async def test_pause_abort_ends_a_running_stream_and_refuses_new_requests_until_resume() -> None:
    async with _serving() as (mock, http):
        assert await _state(http) == AWAKE
        async with http.stream("POST", "/v1/completions", json=_long()) as r:
            lines = r.aiter_lines()
            [first] = await _data(lines, first_only=True)
            assert first["choices"][0]["finish_reason"] is None
            await _post(http, "/pause", {"status": "paused"})
            finish, tokens = _finish_and_usage(await _data(lines))
        assert finish == "abort" and 0 < tokens < LONG
        assert mock.engine.scheduler.num_running == 0
        assert await _state(http) == PAUSED
        _assert_refused(await _complete(http))
        assert (await http.get("/health")).status_code == 200
        await _post(http, "/resume", {"status": "resumed"})
        assert await _state(http) == AWAKE
        r2 = await _complete(http)
        assert r2.status_code == 200 and r2.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "stream": True}),
        ("/v1/completions", {"prompt": ["hi", "there"], "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "stream": True},
        ),
        ("/invocations", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "stream": True}),
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1}}),
        ("/v1/embeddings", {"input": "hi"}),
    ],
    ids=[
        "completion",
        "stream",
        "batch",
        "chat",
        "chat-stream",
        "invocations-stream",
        "sglang-generate",
        "embeddings",
    ],
)
async def test_every_generating_route_is_refused_while_paused(path: str, body: dict[str, Any]) -> None:
    async with _serving() as (mock, http):
        await _post(http, "/pause", {"status": "paused"}, params={"mode": "wait"})
        _assert_refused(await http.post(path, json=body))
        assert not mock.engine.scheduler.has_work and mock.engine.scheduler.num_waiting == 0
        # the utility routes are not generation: they answer as ever
        assert (await http.post("/tokenize", json={"prompt": "hi"})).status_code == 200
        await _post(http, "/resume", {"status": "resumed"})
        assert (await http.post(path, json=body)).status_code == 200


async def test_pause_wait_answers_once_the_running_request_has_drained_refusing_new_ones() -> None:
    async with _serving() as (mock, http):
        engine = mock.engine
        running = asyncio.create_task(http.post("/v1/completions", json=_long(stream=False)))
        await _until(engine, running=1)
        pause = asyncio.create_task(http.post("/pause", params={"mode": "wait", "clear_cache": "false"}))
        while not engine.control.refuses_new:
            await asyncio.sleep(0.001)
        _assert_refused(await _complete(http))
        assert not pause.done()  # (the running request has far to go)
        assert (await pause).json() == {"status": "paused"}
        # answered once drained: the request had run to its end, not been aborted
        assert engine.scheduler.num_running == 0
        whole = (await running).json()
        assert whole["choices"][0]["finish_reason"] == "length"
        assert whole["usage"]["completion_tokens"] == LONG
        assert await _state(http) == PAUSED
        _assert_refused(await _complete(http))
        await _post(http, "/resume", {"status": "resumed"})
        assert (await _complete(http)).status_code == 200


async def test_pause_wait_leaves_a_request_still_queued_in_the_queue_until_resume() -> None:
    """vLLM's ``wait`` drains the running requests only: one its scheduler had not taken in yet
    stays queued (it is the engine's already, so not refused) and runs after the resume."""
    async with _serving(max_num_seqs=1) as (mock, http):
        engine = mock.engine
        running = asyncio.create_task(http.post("/v1/completions", json=_long(stream=False, max_tokens=300)))
        await _until(engine, running=1)
        queued = asyncio.create_task(_complete(http, [7, 8, 9], max_tokens=5))
        await _until(engine, running=1, waiting=1)
        await _post(http, "/pause", {"status": "paused"}, params={"mode": "wait"})
        assert (await running).json()["usage"]["completion_tokens"] == 300
        assert engine.scheduler.num_waiting == 1
        await _held_for_steps(engine)
        assert not queued.done()
        await _post(http, "/resume", {"status": "resumed"})
        assert (await queued).json()["usage"]["completion_tokens"] == 5


async def test_pause_keep_freezes_the_running_request_and_queues_new_ones_until_resume() -> None:
    async with _serving() as (mock, http):
        engine = mock.engine
        async with http.stream("POST", "/v1/completions", json=_long(max_tokens=300)) as r:
            lines = r.aiter_lines()
            await _data(lines, first_only=True)
            await _post(http, "/pause", {"status": "paused"}, params={"mode": "keep", "clear_cache": "false"})
            assert await _state(http) == PAUSED
            assert (await http.get("/ready")).status_code == 200  # (vLLM's pause: it has no /ready)
            queued = asyncio.create_task(_complete(http, [7, 8, 9], max_tokens=5))
            await _until(engine, running=1, waiting=1)  # taken, not refused
            frozen = await _counts(http)
            assert frozen["running"] == 1 and frozen["waiting"] == 1
            [request] = engine.scheduler.running
            made = request.num_output_tokens
            assert 0 < made < 300
            await _held_for_steps(engine)
            assert await _counts(http) == frozen  # no step, no token, the same requests
            assert request.num_output_tokens == made and not queued.done()
            assert engine.pool.num_used > 0  # (it keeps its blocks)
            await _post(http, "/resume", {"status": "resumed"})
            finish, tokens = _finish_and_usage(await _data(lines))
        assert (finish, tokens) == ("length", 300)
        answer = (await queued).json()
        assert answer["choices"][0]["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 5
        assert await _state(http) == AWAKE


async def test_a_keep_pause_that_clears_the_cache_sends_the_frozen_request_back_to_the_queue() -> None:
    """vLLM's engine resets its cache with its running requests on ``clear_cache`` (the default)
    whatever the mode: the frozen request gives its blocks back and recomputes them when resumed."""
    async with _serving() as (mock, http):
        engine = mock.engine
        async with http.stream("POST", "/v1/completions", json=_long(max_tokens=300)) as r:
            lines = r.aiter_lines()
            await _data(lines, first_only=True)
            text = (await http.get("/metrics")).text
            preempted = metric(text, "vllm:num_preemptions_total{")
            await _post(http, "/pause", {"status": "paused"}, params={"mode": "keep"})
            assert engine.scheduler.num_running == 0 and engine.scheduler.num_waiting == 1
            assert engine.pool.num_used == 0
            state = (await http.get("/kvmesh/kv_state")).json()["ranks"][0]
            assert state["events"] == []
            text = (await http.get("/metrics")).text
            assert metric(text, "vllm:num_preemptions_total{") == preempted + 1
            await _post(http, "/resume", {"status": "resumed"})
            finish, tokens = _finish_and_usage(await _data(lines))
        assert (finish, tokens) == ("length", 300)


@pytest.mark.parametrize(
    ("params", "cleared"),
    [
        ({}, True),
        ({"mode": "wait"}, True),
        ({"mode": "abort", "clear_cache": "false"}, False),
        ({"mode": "wait", "clear_cache": "False"}, False),
        ({"mode": "keep", "clear_cache": "0"}, False),
        ({"mode": "keep", "clear_cache": "true"}, True),
    ],
    ids=["abort", "wait", "abort-kept", "wait-kept", "keep-kept", "keep-cleared"],
)
async def test_clear_cache_empties_the_prefix_cache_and_says_so_in_the_kv_events(
    params: dict[str, str], cleared: bool
) -> None:
    async with _serving() as (mock, http):
        events = _Cleared(mock)
        events.subscriber.start()
        try:
            await _cached(http)
            assert await _cached(http) == 4 * BS
            await _post(http, "/pause", {"status": "paused"}, params=params)
            await _post(http, "/resume", {"status": "resumed"})
            assert await events.caught_up(http) == int(cleared)
            assert await _cached(http) == (0 if cleared else 4 * BS)
        finally:
            await events.subscriber.stop()


async def test_a_pause_whose_cache_pins_hold_is_a_500_and_stays_paused() -> None:
    async with _serving() as (_mock, http):
        await _cached(http)
        pin = await http.post("/kvmesh/pin_prefix", json={"token_ids": PROMPT, "ttl_seconds": 60})
        assert pin.status_code == 200, pin.text
        r = await http.post("/pause")
        assert r.status_code == 500 and "pinned" in r.json()["error"]["message"]
        assert await _state(http) == PAUSED
        await _post(http, "/resume", {"status": "resumed"})
        assert await _cached(http) == 4 * BS


# --- vLLM's /sleep and /wake_up -------------------------------------------------------------------


@pytest.mark.parametrize("level", [0, 1, 2])
async def test_a_sleep_takes_new_requests_and_runs_them_on_wake_up(level: int) -> None:
    async with _serving() as (mock, http):
        engine = mock.engine
        await _cached(http)
        await _post(http, "/sleep", {"status": "sleeping", "level": level}, params={"level": str(level)})
        assert await _state(http) == PAUSED
        assert (await http.get("/health")).status_code == 200
        queued = asyncio.create_task(_complete(http))
        await _until(engine, running=0, waiting=1)  # taken, not refused
        await _held_for_steps(engine)
        assert not queued.done()
        await _post(http, "/wake_up", {"status": "awake", "tags": None})
        assert await _state(http) == AWAKE
        answer = await queued
        assert answer.status_code == 200
        # level 0 pauses the scheduler only; level 1 and 2 discard the KV cache
        cached = answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == (4 * BS if level == 0 else 0)


async def test_a_sleep_aborts_running_requests_by_default_and_keeps_them_if_told() -> None:
    async with _serving() as (_mock, http):
        async with http.stream("POST", "/v1/completions", json=_long()) as r:
            lines = r.aiter_lines()
            await _data(lines, first_only=True)
            await _post(http, "/sleep", {"status": "sleeping", "level": 1})
            finish, tokens = _finish_and_usage(await _data(lines))
        assert finish == "abort" and tokens < LONG
        await _post(http, "/wake_up", {"status": "awake", "tags": None})
        async with http.stream("POST", "/v1/completions", json=_long(max_tokens=200)) as r:
            lines = r.aiter_lines()
            await _data(lines, first_only=True)
            sleep = {"status": "sleeping", "level": 0}
            await _post(http, "/sleep", sleep, params={"level": "0", "mode": "keep"})
            await _post(http, "/wake_up", {"status": "awake", "tags": None})
            finish, tokens = _finish_and_usage(await _data(lines))
        assert (finish, tokens) == ("length", 200)


async def test_wake_up_by_tags_resumes_once_nothing_sleeps() -> None:
    async with _serving() as (_mock, http):
        await _post(http, "/sleep", {"status": "sleeping", "level": 1})
        await _post(http, "/wake_up?tags=scheduling", {"status": "sleeping", "tags": ["scheduling"]})
        await _post(http, "/wake_up?tags=weights", {"status": "sleeping", "tags": ["weights"]})
        assert await _state(http) == PAUSED
        await _post(http, "/wake_up?tags=lora", {"status": "sleeping", "tags": ["lora"]})  # (not asleep)
        await _post(http, "/wake_up?tags=kv_cache", {"status": "awake", "tags": ["kv_cache"]})
        assert await _state(http) == AWAKE
        await _post(http, "/sleep", {"status": "sleeping", "level": 0}, params={"level": "0"})
        await _post(http, "/wake_up?tags=scheduling", {"status": "awake", "tags": ["scheduling"]})
        assert await _state(http) == AWAKE
        assert (await _complete(http)).status_code == 200


async def test_a_resume_wakes_the_scheduler_and_leaves_the_weights_asleep() -> None:
    async with _serving() as (_mock, http):
        await _post(http, "/sleep", {"status": "sleeping", "level": 2}, params={"level": "2"})
        await _post(http, "/resume", {"status": "resumed"})
        assert await _state(http) == {"is_paused": False, "is_sleeping": True}
        await _post(http, "/wake_up", {"status": "awake", "tags": None})
        assert await _state(http) == AWAKE


@pytest.mark.parametrize(
    ("path", "field"),
    [
        ("/pause?mode=drain", "query.mode"),
        ("/pause?mode=retract", "query.mode"),
        ("/pause?clear_cache=maybe", "query.clear_cache"),
        ("/sleep?level=3", "query.level"),
        ("/sleep?level=-1", "query.level"),
        ("/sleep?level=one", "query.level"),
        ("/sleep?mode=in_place", "query.mode"),
    ],
)
async def test_a_bad_argument_is_a_400_naming_it_and_changes_nothing(path: str, field: str) -> None:
    async with _serving() as (_mock, http):
        r = await http.post(path)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field
        assert await _state(http) == AWAKE


# --- SGLang's /pause_generation and /continue_generation ------------------------------------------

SGLANG_PAUSED = {"message": "Generation paused successfully.", "status": "ok"}
SGLANG_CONTINUED = {"message": "Generation continued successfully.", "status": "ok"}


def _generate(max_new_tokens: int, stream: bool = True) -> dict[str, Any]:
    params = {"max_new_tokens": max_new_tokens, "ignore_eos": True}
    return {"text": TEXT, "sampling_params": params, "stream": stream}


async def test_pause_generation_abort_ends_running_requests_and_holds_new_ones() -> None:
    async with _serving() as (mock, http):
        engine = mock.engine
        async with http.stream("POST", "/generate", json=_generate(LONG)) as r:
            lines = r.aiter_lines()
            await _data(lines, first_only=True)
            await _post(http, "/pause_generation", SGLANG_PAUSED, json={"mode": "abort"})
            *_, last, done = await _data(lines)
        assert done == "[DONE]" and last["meta_info"]["finish_reason"]["type"] == "abort"
        held = asyncio.create_task(http.post("/generate", json=_generate(5, stream=False)))
        await _until(engine, running=0, waiting=1)  # it waits: SGLang refuses none
        await _held_for_steps(engine)
        assert not held.done()
        await _post(http, "/continue_generation", SGLANG_CONTINUED, json={})
        answer = (await held).json()
        assert answer["meta_info"]["finish_reason"] == {"type": "length", "length": 5}


@pytest.mark.parametrize("mode", ["in_place", "retract"])
async def test_pause_generation_freezes_running_requests_until_continued(mode: str) -> None:
    async with _serving() as (mock, http):
        engine = mock.engine
        async with http.stream("POST", "/generate", json=_generate(300)) as r:
            lines = r.aiter_lines()
            await _data(lines, first_only=True)
            assert (await http.get("/ready")).status_code == 200
            await _post(http, "/pause_generation", SGLANG_PAUSED, json={"mode": mode})
            assert await _state(http) == PAUSED
            assert (await http.get("/ready")).status_code == 503  # (SGLang's readiness while paused)
            before = await _counts(http)
            if mode == "retract":  # back in the queue, its blocks freed (cached: a flush may follow)
                assert (before["running"], before["waiting"]) == (0, 1) and engine.pool.num_used == 0
            else:
                assert (before["running"], before["waiting"]) == (1, 0) and engine.pool.num_used > 0
            await _held_for_steps(engine)
            assert await _counts(http) == before
            await _post(http, "/continue_generation", SGLANG_CONTINUED, json={})
            *_, last, done = await _data(lines)
        assert done == "[DONE]"
        assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 300}
        assert last["meta_info"]["completion_tokens"] == 300
        assert await _state(http) == AWAKE
        assert (await http.get("/ready")).status_code == 200


@pytest.mark.parametrize(
    ("path", "content", "field"),
    [
        ("/pause_generation", b'{"mode": "keep"}', "mode"),
        ("/pause_generation", b'{"mode": 1}', "mode"),
        ("/pause_generation", b"", "body"),
        ("/pause_generation", b"[]", "body"),
        ("/pause_generation", b"{", "body"),
        ("/continue_generation", b"", "body"),
    ],
)
async def test_a_bad_sglang_body_is_a_400_naming_the_field(path: str, content: bytes, field: str) -> None:
    async with _serving() as (_mock, http):
        r = await http.post(path, content=content, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field
        assert await _state(http) == AWAKE
