"""The mock's OpenAI-compatible server, driven by the official openai client and raw httpx on loopback."""

from __future__ import annotations

import asyncio
import json
import os

import httpx
import openai
import pytest

from kvmesh.mock.engine import GenerationParams
from kvmesh.mock.testing import run_mock
from kvmesh.router.request.tokenizer import BuiltinTokenizer

pytestmark = pytest.mark.e2e

MODEL = "kvmesh-mock"
SYSTEM = {"role": "system", "content": "You are a helpful assistant who answers briefly. " * 12}


def _client(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)


async def wait_idle(engine, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    """Until the engine has nothing scheduled (its aborted requests gone too)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while engine.scheduler.has_work:
        assert asyncio.get_running_loop().time() < deadline, "engine did not go idle"
        await asyncio.sleep(0.01)


async def test_openai_client_chat_and_completions() -> None:
    async with run_mock(block_size=16, num_blocks=256, speedup=20) as mock, _client(mock.base_url) as client:
        messages = [SYSTEM, {"role": "user", "content": "Say hello."}]
        first = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=7)  # type: ignore[arg-type]
        assert first.object == "chat.completion"
        assert first.choices[0].finish_reason == "length"
        assert first.choices[0].message.role == "assistant" and first.choices[0].message.content
        assert first.usage is not None
        prompt_len = len(BuiltinTokenizer().apply_chat_template(messages))
        assert first.usage.prompt_tokens == prompt_len
        assert first.usage.completion_tokens == 7
        assert first.usage.total_tokens == prompt_len + 7
        assert first.usage.prompt_tokens_details is not None
        assert first.usage.prompt_tokens_details.cached_tokens == 0

        # Same conversation again: every full block but the one holding the last token is cached.
        again = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=7)  # type: ignore[arg-type]
        assert again.usage is not None and again.usage.prompt_tokens_details is not None
        assert again.usage.prompt_tokens_details.cached_tokens == (prompt_len - 1) // 16 * 16
        assert again.choices[0].message.content == first.choices[0].message.content  # same seed, same output

        completion = await client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4)
        assert completion.object == "text_completion"
        assert completion.choices[0].finish_reason == "length" and completion.choices[0].text
        assert completion.usage is not None and completion.usage.completion_tokens == 4

        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL]


async def test_openai_client_streaming_with_usage() -> None:
    async with run_mock(block_size=16, num_blocks=256, speedup=20) as mock, _client(mock.base_url) as client:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[SYSTEM, {"role": "user", "content": "Count."}],  # type: ignore[list-item]
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        content = [c for c in chunks if c.choices and c.choices[0].delta.content]
        assert content and all(c.choices[0].finish_reason is None for c in chunks[:-2])
        assert chunks[-2].choices[0].finish_reason == "length"
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == 6
        assert all(c.usage is None for c in chunks[:-1])
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

        full = await client.chat.completions.create(
            model=MODEL,
            messages=[SYSTEM, {"role": "user", "content": "Count."}],  # type: ignore[list-item]
            max_tokens=6,
        )
        assert full.choices[0].message.content == text

        completion_stream = await client.completions.create(
            model=MODEL, prompt=[5000, 5001, 5002], max_tokens=3, stream=True
        )
        parts = [c async for c in completion_stream]
        assert [p.choices[0].finish_reason for p in parts] == [None, None, "length"]


async def test_raw_sse_framing_ends_with_done() -> None:
    async with (
        run_mock(block_size=16, num_blocks=64, speedup=50) as mock,
        httpx.AsyncClient(base_url=mock.base_url) as http,
    ):
        body = {"model": MODEL, "prompt": "abc", "max_tokens": 2, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            raw = (await r.aread()).decode()
        events = raw.split("\n\n")
        assert events[-1] == "" and events[-2] == "data: [DONE]"
        payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
        assert [p["object"] for p in payloads] == ["text_completion"] * 2
        assert "usage" not in payloads[0]  # only with stream_options.include_usage


@pytest.mark.parametrize(
    ("path", "body", "param", "message"),
    [
        pytest.param("/v1/chat/completions", {"model": MODEL}, "messages", "required", id="no-messages"),
        pytest.param(
            "/v1/chat/completions",
            {"messages": [{"role": "robot", "content": "x"}]},
            "messages[0].role",
            "must be one of",
            id="role",
        ),
        pytest.param(
            "/v1/completions",
            {"prompt": "x", "max_tokens": 0},
            "max_tokens",
            "positive integer",
            id="max-tokens",
        ),
        pytest.param(
            "/v1/completions",
            {"prompt": "x", "max_tokens": 10**6},
            "max_tokens",
            "maximum context length",
            id="too-long",
        ),
        pytest.param(
            "/v1/completions", {"prompt": "x", "stream": "yes"}, "stream", "must be a boolean", id="stream"
        ),
        pytest.param(
            "/v1/completions",
            {"prompt": "x", "stream_options": {"include_usage": True}},
            "stream_options",
            "only be defined when",
            id="stream-options",
        ),
        pytest.param("/v1/completions", {"prompt": "x", "n": 0}, "n", "positive integer", id="n-zero"),
        pytest.param("/v1/completions", {"prompt": "x", "n": 65}, "n", "at most 64", id="n-many"),
        pytest.param(
            "/v1/completions",
            {"prompt": "x", "n": 2, "kv_transfer_params": {"do_remote_decode": True}},
            "n",
            "disaggregated",
            id="n-handoff",
        ),
        pytest.param("/v1/completions", {"prompt": "x", "echo": 1}, "echo", "must be a boolean", id="echo"),
        pytest.param(
            "/v1/completions",
            {"prompt": "x", "prompt_logprobs": 1},
            "prompt_logprobs",
            "not supported",
            id="prompt-logprobs",
        ),
        pytest.param(
            "/v1/chat/completions",
            {"messages": [{"role": "assistant", "content": "x"}], "continue_final_message": True},
            "continue_final_message",
            "Cannot set both",
            id="continue-with-generation-prompt",
        ),
        pytest.param(
            "/v1/completions", {"prompt": "x", "temperature": 3}, "temperature", "in [0, 2]", id="temperature"
        ),
        pytest.param(
            "/v1/completions",
            {"prompt": "x", "priority": 1},
            "priority",
            "--scheduling-policy priority",
            id="priority-fcfs",
        ),
        pytest.param(
            "/v1/completions",
            {"prompt": "x", "min_tokens": 5, "max_tokens": 2},
            "min_tokens",
            "at most",
            id="min-tokens",
        ),
        pytest.param(
            "/v1/completions",
            {"prompt": "x", "session_params": {"id": 3}},
            "session_params.id",
            "string",
            id="session",
        ),
    ],
)
async def test_bad_requests_get_openai_style_400s_naming_the_field(
    path: str, body: dict, param: str, message: str
) -> None:
    async with (
        run_mock(block_size=16, num_blocks=64, events=False) as mock,
        httpx.AsyncClient(base_url=mock.base_url) as http,
    ):
        r = await http.post(path, json=body)
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["param"] == param and error["code"] == 400 and error["type"] == "BadRequestError"
        assert message in error["message"]


async def test_openai_client_sees_the_error() -> None:
    async with run_mock(block_size=16, num_blocks=64, events=False) as mock, _client(mock.base_url) as client:
        with pytest.raises(openai.BadRequestError, match="positive integer") as info:
            await client.completions.create(model=MODEL, prompt="x", max_tokens=-1)
        assert isinstance(info.value.body, dict) and info.value.body["param"] == "max_tokens"
        with pytest.raises(openai.NotFoundError, match="The model `gpt-4` does not exist"):
            await client.completions.create(model="gpt-4", prompt="x", max_tokens=1)


async def test_health_models_and_metrics() -> None:
    async with (
        run_mock(block_size=16, num_blocks=64, speedup=50) as mock,
        httpx.AsyncClient(base_url=mock.base_url) as http,
    ):
        assert (await http.get("/health")).status_code == 200
        r = await http.post("/v1/completions", json={"prompt": "hello " * 40, "max_tokens": 3})
        assert r.status_code == 200
        await http.post("/v1/completions", json={"prompt": "hello " * 40, "max_tokens": 3})
        text = (await http.get("/metrics")).text
        for name in (
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc",
        ):
            assert f'{name}{{model_name="kvmesh-mock"}} 0.0' in text
        queries = metric(text, "vllm:prefix_cache_queries_total")
        hits = metric(text, "vllm:prefix_cache_hits_total")
        prompt_tokens = r.json()["usage"]["prompt_tokens"]
        assert queries == 2 * prompt_tokens
        assert hits == (prompt_tokens - 1) // 16 * 16
        assert metric(text, 'vllm:request_success_total{finished_reason="length",') == 2


def metric(text: str, prefix: str) -> float:
    """The value of the first series in a Prometheus exposition that starts with ``prefix``."""
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no metric {prefix} in:\n{text}")


@pytest.mark.parametrize("n", [1, 3], ids=["one-choice", "three-choices"])
async def test_a_client_disconnect_aborts_the_request_and_frees_its_blocks(n: int) -> None:
    async with (
        run_mock(block_size=16, num_blocks=128, speedup=5) as mock,
        httpx.AsyncClient(base_url=mock.base_url) as http,
    ):
        engine = mock.engine
        body = {"prompt": "tell me a long story " * 20, "max_tokens": 1500, "n": n, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.aiter_lines()
            assert (await anext(lines)).startswith("data: ")
            assert engine.scheduler.num_running == n  # (every choice an engine request)
        await wait_idle(engine)
        assert engine.pool.num_used == 0

        # A non-streaming request whose client gives up is aborted too.
        with pytest.raises(httpx.ReadTimeout):
            await http.post(
                "/v1/completions", json={"prompt": "again", "max_tokens": 1500, "n": n}, timeout=0.3
            )
        await wait_idle(engine)
        assert engine.pool.num_used == 0
        text = (await http.get("/metrics")).text
        assert metric(text, 'vllm:request_success_total{finished_reason="abort",') == 2 * n


async def test_n_choices_are_streamed_one_per_event_and_counted_once_per_prompt() -> None:
    async with run_mock(block_size=16, num_blocks=256, speedup=20) as mock, _client(mock.base_url) as client:
        messages = [SYSTEM, {"role": "user", "content": "Pick a number."}]
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=6,
            n=3,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
        assert all(len(c.choices) == 1 for c in chunks[:-1])  # as vLLM: one choice per event
        assert [c.choices[0].delta.role for c in chunks[:3]] == ["assistant"] * 3
        text = {
            i: "".join(c.choices[0].delta.content or "" for c in chunks[:-1] if c.choices[0].index == i)
            for i in range(3)
        }
        finished = [c.choices[0].index for c in chunks[:-1] if c.choices[0].finish_reason == "length"]
        assert sorted(finished) == [0, 1, 2]
        assert len(set(text.values())) == 3  # each choice samples for itself
        usage = chunks[-1].usage
        assert usage is not None
        assert usage.prompt_tokens == len(BuiltinTokenizer().apply_chat_template(messages))
        assert usage.completion_tokens == 18

        # the first choice is the answer n=1 gives, and the whole answer holds the same choices
        one = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6)  # type: ignore[arg-type]
        assert one.choices[0].message.content == text[0]
        full = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, n=3)  # type: ignore[arg-type]
        assert [c.index for c in full.choices] == [0, 1, 2]
        assert [c.message.content for c in full.choices] == [text[0], text[1], text[2]]
        assert full.usage is not None and full.usage.completion_tokens == 18


async def test_echo_puts_the_prompt_before_each_answer_as_vllm_does() -> None:
    async with run_mock(block_size=16, num_blocks=256, speedup=20) as mock, _client(mock.base_url) as client:
        plain = await client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, n=2)
        echoed = await client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=5, n=2, echo=True
        )
        assert [c.text for c in echoed.choices] == ["Once upon a time" + c.text for c in plain.choices]
        parts = [
            c
            async for c in await client.completions.create(
                model=MODEL, prompt="Once upon a time", max_tokens=5, echo=True, stream=True
            )
        ]
        assert parts[0].choices[0].text.startswith("Once upon a time")
        assert "".join(p.choices[0].text for p in parts) == echoed.choices[0].text

        # a chat echoes the last message when the answer continues it, in an event of its own
        opening = {"role": "assistant", "content": "The answer is"}
        messages = [{"role": "user", "content": "What is it?"}, opening]
        chunks = [
            c
            async for c in await client.chat.completions.create(
                model=MODEL,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=4,
                stream=True,
                extra_body={"echo": True, "add_generation_prompt": False},
            )
        ]
        assert chunks[1].choices[0].delta.content == "The answer is"
        whole = await client.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=4,
            extra_body={"echo": True, "add_generation_prompt": False},
        )
        assert whole.choices[0].message.content == "".join(c.choices[0].delta.content or "" for c in chunks)
        # ... and nothing when the answer is a new turn after a user's message
        asked = await client.chat.completions.create(
            model=MODEL,
            messages=messages[:1],
            max_tokens=4,
            extra_body={"echo": True},  # type: ignore[arg-type]
        )
        plain_chat = await client.chat.completions.create(model=MODEL, messages=messages[:1], max_tokens=4)  # type: ignore[arg-type]
        assert asked.choices[0].message.content == plain_chat.choices[0].message.content


async def test_a_chat_echo_reads_no_cached_prefix_as_in_vllm() -> None:
    """vLLM asks for prompt logprobs with a chat ``echo`` (``top_logprobs`` is 0, not null) and so
    reads none of the prefix cache for it; the mock does the same."""
    async with run_mock(block_size=16, num_blocks=256, speedup=50) as mock, _client(mock.base_url) as client:
        messages = [SYSTEM, {"role": "user", "content": "Again, please."}]

        async def cached(**extra: object) -> int:
            answer = await client.chat.completions.create(
                model=MODEL,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=2,
                extra_body=extra,  # type: ignore[arg-type]
            )
            assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
            return int(answer.usage.prompt_tokens_details.cached_tokens or 0)

        assert await cached() == 0
        assert await cached() > 0
        assert await cached(echo=True) == 0
        assert await cached(echo=True, top_logprobs=None) > 0


async def test_outputs_depend_on_the_seed_only() -> None:
    async with (
        run_mock(block_size=16, num_blocks=64, speedup=50, seed=3) as mock,
        httpx.AsyncClient(base_url=mock.base_url) as http,
    ):

        async def text(**extra: object) -> str:
            r = await http.post("/v1/completions", json={"prompt": "same prompt", "max_tokens": 12, **extra})
            return str(r.json()["choices"][0]["text"])

        default = await text()
        assert default == await text() == await text(seed=3)
        assert await text(seed=4) != default
    async with (
        run_mock(block_size=16, num_blocks=64, speedup=50, seed=3) as other,
        httpx.AsyncClient(base_url=other.base_url) as http,
    ):
        r = await http.post("/v1/completions", json={"prompt": "same prompt", "max_tokens": 12})
        assert r.json()["choices"][0]["text"] == default  # another process-lifetime, same seed


async def test_without_max_tokens_a_request_stops_at_a_natural_length() -> None:
    async with (
        run_mock(block_size=16, num_blocks=128, speedup=50) as mock,
        httpx.AsyncClient(base_url=mock.base_url) as http,
    ):
        r = (await http.post("/v1/completions", json={"prompt": "open ended"})).json()
        assert r["choices"][0]["finish_reason"] == "stop"
        assert 16 <= r["usage"]["completion_tokens"] <= 129
        fixed = (
            await http.post(
                "/v1/completions", json={"prompt": "open ended", "max_tokens": 300, "ignore_eos": True}
            )
        ).json()
        assert fixed["choices"][0]["finish_reason"] == "length" and fixed["usage"]["completion_tokens"] == 300


async def test_the_queue_time_is_the_wait_for_the_step_running_when_a_request_came() -> None:
    """``vllm:request_queue_time_seconds``: a request that reaches an idle engine is taken in at
    once; one that arrives while another's prefill step runs waits for that step to end."""
    async with (
        run_mock(block_size=16, num_blocks=512, speedup=0.25, events=False) as mock,
        httpx.AsyncClient(base_url=mock.base_url) as http,
    ):
        engine = mock.engine
        first = engine.submit(GenerationParams(list(range(1, 1601)), max_tokens=2))
        while first.scheduled_time is None:  # its 1,600-token prefill step has started
            await asyncio.sleep(0.001)
        assert first.first_token_time is None
        second = engine.submit(GenerationParams(list(range(5001, 5101)), max_tokens=2))
        async for _ in second.deltas():
            pass
        await first.wait()
        assert first.scheduled_time is not None and second.scheduled_time is not None
        assert first.first_token_time is not None
        # the first one's step ended with its first token; only then was the second taken in
        assert second.scheduled_time >= first.first_token_time
        waits = [s.scheduled_time - s.arrival for s in (first, second)]  # type: ignore[operator]
        text = (await http.get("/metrics")).text
        assert metric(text, "vllm:request_queue_time_seconds_count") == 2
        assert metric(text, "vllm:request_queue_time_seconds_sum") == pytest.approx(sum(waits))
        assert waits[0] < waits[1]


async def test_the_request_log_has_a_line_per_ended_request_with_the_engines_own_times(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``--request-log``: every request that ends (answered or aborted) leaves one JSON line with
    the times the engine itself saw; requests one step takes in share its number."""
    log = tmp_path / "requests.jsonl"
    async with (
        run_mock(block_size=16, num_blocks=512, speedup=2, events=False, request_log=str(log)) as mock,
        httpx.AsyncClient(base_url=mock.base_url) as http,
    ):
        engine = mock.engine
        answered = await http.post(
            "/v1/completions", json={"prompt": "count to three " * 40, "max_tokens": 3}
        )
        assert answered.status_code == 200
        # two siblings submitted before the loop runs again: one step takes both in
        pair = [engine.submit(GenerationParams(list(range(1, 321)), max_tokens=2)) for _ in range(2)]
        for stream in pair:
            await stream.wait()
        # a streaming client that leaves after its first event: the request is aborted
        body = {"prompt": "tell me a long story " * 20, "max_tokens": 1500, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.aiter_lines()
            assert (await anext(lines)).startswith("data: ")
        await wait_idle(engine)
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["finish_reason"] for r in rows] == ["length", "length", "length", "abort"]
    first, sib_a, sib_b, aborted = rows
    assert first["output_tokens"] == 3 and first["prompt_tokens"] == answered.json()["usage"]["prompt_tokens"]
    for r in (first, sib_a, sib_b):
        assert r["arrival"] <= r["scheduled"] <= r["first_token"] <= r["finished"]
    assert sib_a["step"] == sib_b["step"] > first["step"]
    assert sib_a["prompt_tokens"] == sib_b["prompt_tokens"] == 320
    assert aborted["first_token"] is not None and aborted["output_tokens"] < 1500
    assert len({r["request_id"] for r in rows}) == 4


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
async def test_a_request_log_that_cannot_be_written_stops_the_log_not_the_engine() -> None:
    async with (
        run_mock(block_size=16, num_blocks=256, speedup=20, events=False, request_log="/dev/full") as mock,
        httpx.AsyncClient(base_url=mock.base_url) as http,
    ):
        for _ in range(2):  # the second request is served by an engine whose log has stopped
            r = await http.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert mock.engine._request_log is None
