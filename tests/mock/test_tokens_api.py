"""The mock's vLLM token-in-token-out API (``POST /inference/v1/generate``) and its abort
(``POST /inference/v1/abort_requests``, ``POST /abort_requests``), driven over HTTP on loopback.

The mock answers as vLLM 0.33.0 does: ``{"request_id": "generate-tokens-...", "choices": [{"index",
"finish_reason", "stop_reason", "token_ids", ...}], "usage", "output_mode": "tokens", ...}``; a stream
of ``data:`` events, each a choice's new tokens only, the usage after them if asked, then ``[DONE]``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from kvmesh.mock.testing import run_mock
from kvmesh.router.request.tokenizer import BuiltinTokenizer
from tests.mock.test_generate import _events
from tests.mock.test_server import metric, wait_idle

pytestmark = pytest.mark.e2e

PATH = "/inference/v1/generate"
BS = 16
PROMPT = list(range(300, 340))  # 40 tokens: two whole blocks and a part


def _body(**fields: Any) -> dict[str, Any]:
    params = {"max_tokens": 5, "ignore_eos": True}
    return {"token_ids": PROMPT, "sampling_params": params, **fields}


def _joined(events: list[Any]) -> dict[int, list[int]]:
    """Each choice's tokens, the events' ``token_ids`` put end to end."""
    out: dict[int, list[int]] = {}
    for event in events:
        for choice in event["choices"]:
            out.setdefault(choice["index"], []).extend(choice["token_ids"])
    return out


async def test_a_whole_answer_carries_the_tokens_and_the_cached_prompt() -> None:
    async with (
        run_mock(block_size=BS, num_blocks=256, speedup=20) as mock,
        httpx.AsyncClient(base_url=mock.base_url) as http,
    ):
        r = await http.post(PATH, json=_body(request_id="r-1", return_token_ids=True))
        assert r.status_code == 200, r.text
        first = r.json()
        assert first["request_id"] == "generate-tokens-r-1"
        assert first["output_mode"] == "tokens" and first["model"] == mock.config.model
        assert isinstance(first["created"], int)
        assert first["prompt_token_ids"] == PROMPT
        assert first["kv_transfer_params"] is None and first["prompt_logprobs"] is None
        [choice] = first["choices"]
        assert choice["index"] == 0 and choice["finish_reason"] == "length"
        assert choice["stop_reason"] is None and choice["logprobs"] is None
        assert len(choice["token_ids"]) == 5 and "text" not in choice
        assert first["usage"] == {
            "prompt_tokens": 40,
            "completion_tokens": 5,
            "total_tokens": 45,
            "prompt_tokens_details": {"cached_tokens": 0},
        }

        # Again: the prompt's whole blocks are cached, and the (deterministic) answer is the same.
        # X-Request-Id comes before the body's request_id, and no request_id is a new uuid.
        again = (await http.post(PATH, json=_body(request_id="r-2"), headers={"X-Request-Id": "h"})).json()
        assert again["request_id"] == "generate-tokens-h"
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 2 * BS
        assert again["choices"][0]["token_ids"] == choice["token_ids"]
        assert again["prompt_token_ids"] is None  # (not asked)
        fresh = (await http.post(PATH, json=_body())).json()
        assert len(fresh["request_id"]) == len("generate-tokens-") + 32

        # skip_reading_prefix_cache computes the prompt whole: nothing read from the cache.
        skip = _body()
        skip["sampling_params"]["skip_reading_prefix_cache"] = True
        skipped = (await http.post(PATH, json=skip)).json()
        assert skipped["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

        # output_mode "text": each choice carries its text too.
        text = (await http.post(PATH, json=_body(output_mode="text"))).json()
        assert text["output_mode"] == "text"
        assert text["choices"][0]["text"] == BuiltinTokenizer().decode(choice["token_ids"])


async def test_a_stream_sends_new_tokens_then_the_usage_then_done() -> None:
    async with (
        run_mock(block_size=BS, num_blocks=256, speedup=20) as mock,
        httpx.AsyncClient(base_url=mock.base_url) as http,
    ):
        body = _body()
        body["sampling_params"]["max_tokens"] = 9
        whole = (await http.post(PATH, json=body)).json()
        options = {"include_usage": True}
        async with http.stream(
            "POST", PATH, json={**body, "stream": True, "stream_options": options, "request_id": "s"}
        ) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            events = _events((await r.aread()).decode())
        assert events[-1] == "[DONE]"
        *chunks, usage_event = events[:-1]
        assert len(chunks) >= 2  # (an event a step)
        assert all(e["request_id"] == "generate-tokens-s" and e["output_mode"] == "tokens" for e in chunks)
        assert all(e["usage"] is None and len(e["choices"]) == 1 for e in chunks)
        assert all(e["choices"][0]["token_ids"] for e in chunks)  # (new tokens, never none)
        assert [e["choices"][0]["finish_reason"] for e in chunks] == [None] * (len(chunks) - 1) + ["length"]
        # Each event carries only its new tokens: end to end they are the whole answer's.
        assert _joined(chunks) == {0: whole["choices"][0]["token_ids"]}
        assert usage_event["choices"] == [] and usage_event["request_id"] == "generate-tokens-s"
        assert usage_event["usage"] == {
            "prompt_tokens": 40,
            "completion_tokens": 9,
            "total_tokens": 49,
            "prompt_tokens_details": {"cached_tokens": 2 * BS},
        }

        # Without include_usage no usage event; with continuous_usage_stats each event counts so far.
        async with http.stream("POST", PATH, json={**body, "stream": True}) as r:
            plain = _events((await r.aread()).decode())
        assert plain[-1] == "[DONE]" and all(e["choices"] for e in plain[:-1])
        options = {"include_usage": True, "continuous_usage_stats": True}
        async with http.stream("POST", PATH, json={**body, "stream": True, "stream_options": options}) as r:
            counted = _events((await r.aread()).decode())[:-2]
        seen = 0
        for event in counted:
            seen += len(event["choices"][0]["token_ids"])
            assert event["usage"]["completion_tokens"] == seen
        assert seen == 9


async def test_n_choices_each_with_its_index() -> None:
    async with (
        run_mock(block_size=BS, num_blocks=256, speedup=20) as mock,
        httpx.AsyncClient(base_url=mock.base_url) as http,
    ):
        body = _body()
        body["sampling_params"]["n"] = 2
        whole = (await http.post(PATH, json=body)).json()
        choices = whole["choices"]
        assert [c["index"] for c in choices] == [0, 1]
        assert all(len(c["token_ids"]) == 5 and c["finish_reason"] == "length" for c in choices)
        assert choices[0]["token_ids"] != choices[1]["token_ids"]
        assert whole["usage"]["completion_tokens"] == 10 and whole["usage"]["prompt_tokens"] == 40

        async with http.stream("POST", PATH, json={**body, "stream": True}) as r:
            events = _events((await r.aread()).decode())
        assert events[-1] == "[DONE]"
        assert _joined(events[:-1]) == {0: choices[0]["token_ids"], 1: choices[1]["token_ids"]}
        last = {e["choices"][0]["index"]: e["choices"][0]["finish_reason"] for e in events[:-1]}
        assert last == {0: "length", 1: "length"}


async def test_max_tokens_left_out_is_the_room_the_context_leaves() -> None:
    async with (
        run_mock(block_size=BS, num_blocks=256, max_model_len=60, speedup=20) as mock,
        httpx.AsyncClient(base_url=mock.base_url) as http,
    ):
        r = await http.post(PATH, json={"token_ids": PROMPT, "sampling_params": {"ignore_eos": True}})
        assert r.status_code == 200, r.text
        answer = r.json()
        assert answer["usage"]["completion_tokens"] == 60 - 40  # (not SamplingParams' 16)
        assert answer["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        pytest.param({"sampling_params": {}}, "token_ids", id="no-token-ids"),
        pytest.param({"token_ids": [], "sampling_params": {}}, "token_ids", id="empty"),
        pytest.param({"token_ids": [1, -2], "sampling_params": {}}, "token_ids", id="negative-id"),
        pytest.param({"token_ids": [1, "a"], "sampling_params": {}}, "token_ids", id="text-id"),
        pytest.param({"token_ids": [1, 2]}, "sampling_params", id="no-sampling-params"),
        pytest.param({"token_ids": [1], "sampling_params": [{}]}, "sampling_params", id="params-list"),
        pytest.param({"token_ids": [1], "sampling_params": {"logprobs": 1}}, "sampling_params.logprobs"),
        pytest.param(
            {"token_ids": [1], "sampling_params": {"prompt_logprobs": 0}}, "sampling_params.prompt_logprobs"
        ),
        pytest.param(
            {"token_ids": [1], "sampling_params": {"structured_outputs": {"regex": "a+"}}},
            "sampling_params.structured_outputs",
        ),
        pytest.param(
            {"token_ids": [1], "sampling_params": {"logit_bias": {"5": 1.0}}}, "sampling_params.logit_bias"
        ),
        pytest.param(
            {"token_ids": [1], "sampling_params": {"stop_token_ids": [7]}}, "sampling_params.stop_token_ids"
        ),
        pytest.param({"token_ids": [1], "sampling_params": {"max_tokens": 0}}, "sampling_params.max_tokens"),
        pytest.param(
            {"token_ids": [1], "sampling_params": {"min_tokens": 5, "max_tokens": 2}},
            "sampling_params.min_tokens",
        ),
        pytest.param({"token_ids": [1], "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
        pytest.param({"token_ids": [1], "sampling_params": {"n": None}}, "sampling_params.n", id="null-n"),
        pytest.param(
            {"token_ids": [1], "sampling_params": {"n": 2, "temperature": 0}},
            "sampling_params.n",
            id="greedy-n",
        ),
        pytest.param({"token_ids": [1], "sampling_params": {"min_p": 2}}, "sampling_params.min_p"),
        pytest.param({"token_ids": [1], "sampling_params": {}, "cache_salt": "s"}, "cache_salt"),
        pytest.param(
            {"token_ids": [1], "sampling_params": {}, "content_parts": [{"type": "image_url"}]},
            "content_parts",
        ),
        pytest.param({"token_ids": [1], "sampling_params": {}, "output_mode": "derender"}, "output_mode"),
        pytest.param({"token_ids": [1], "sampling_params": {}, "output_mode": "words"}, "output_mode"),
        pytest.param(
            {"token_ids": [1], "sampling_params": {"detokenize": False}, "output_mode": "text"}, "output_mode"
        ),
        pytest.param({"token_ids": [1], "sampling_params": {}, "request_id": 5}, "request_id"),
        pytest.param(
            {"token_ids": [1], "sampling_params": {}, "priority": 1}, "priority", id="priority-fcfs"
        ),
        pytest.param({"token_ids": [1], "sampling_params": {}, "stream": "yes"}, "stream"),
        pytest.param(
            {"token_ids": [1], "sampling_params": {}, "stream_options": {"include_usage": 1}},
            "stream_options.include_usage",
        ),
        pytest.param({"token_ids": [1] * 4096, "sampling_params": {}}, "token_ids", id="too-long"),
        pytest.param([{"token_ids": [1]}], "body", id="not-an-object"),
    ],
)
async def test_a_body_the_engine_cannot_serve_is_a_400_naming_the_field(body: Any, field: str) -> None:
    async with (
        run_mock(speedup=20, block_size=BS, num_blocks=256) as mock,
        httpx.AsyncClient(base_url=mock.base_url) as http,
    ):
        r = await http.post(PATH, json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field
        bad = await http.post(PATH, content=b"{not json")
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "body"


async def test_fields_that_change_nothing_here_are_taken_and_unknown_sampling_keys_ignored() -> None:
    async with (
        run_mock(block_size=BS, num_blocks=256, speedup=20) as mock,
        httpx.AsyncClient(base_url=mock.base_url) as http,
    ):
        params = {
            "max_tokens": 2,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 20,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "seed": -1,
            "stop": ["\n"],
            "logprobs": None,  # (null asks nothing)
            "logit_bias": {},
            "stop_token_ids": [],
            "skip_special_tokens": False,
            "thinking_token_budget": -1,
            "max_new_tokens": 99,  # (not vLLM's: SamplingParams ignores it, and so does the mock)
        }
        body = {
            "token_ids": PROMPT,
            "sampling_params": params,
            "model": None,
            "stream_options": {"include_usage": True},  # (vLLM takes it without stream too)
            "reasoning_ended": True,
            "some_future_field": 1,
        }
        r = await http.post(PATH, json=body)
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"][0]["token_ids"]) == 2


async def test_priority_orders_the_queue_lower_first() -> None:
    async with (
        run_mock(
            block_size=BS, num_blocks=256, max_num_seqs=1, speedup=1, scheduling_policy="priority"
        ) as mock,
        httpx.AsyncClient(base_url=mock.base_url, timeout=30) as http,
    ):
        order: list[int] = []

        async def short(i: int, priority: int) -> None:
            body = {"token_ids": [100 + i] * 20, "sampling_params": {"max_tokens": 2}, "priority": priority}
            r = await http.post(PATH, json=body)
            assert r.status_code == 200, r.text
            order.append(i)

        blocker = asyncio.create_task(
            http.post(
                PATH, json={"token_ids": [7] * 20, "sampling_params": {"max_tokens": 30, "ignore_eos": True}}
            )
        )
        while mock.engine.scheduler.num_running == 0:
            await asyncio.sleep(0.002)
        tasks = []
        for i, priority in enumerate([3, -1, 0]):
            tasks.append(asyncio.create_task(short(i, priority)))
            while mock.engine.scheduler.num_waiting < i + 1:  # queued in this order
                await asyncio.sleep(0.002)
        assert mock.engine.scheduler.num_running == 1  # all of them wait behind the blocker
        await asyncio.gather(blocker, *tasks)
        assert order == [1, 2, 0]


async def _data(lines: Any, first_only: bool = False) -> list[Any]:
    """The ``data:`` payloads of the stream's lines (``[DONE]`` kept as the string)."""
    out: list[Any] = []
    async for line in lines:
        if line:
            out.extend(_events(line + "\n\n"))
            if first_only:
                break
    return out


async def test_abort_requests_ends_a_stream_with_abort_and_frees_the_engine() -> None:
    async with (
        run_mock(block_size=BS, num_blocks=256, speedup=5) as mock,
        httpx.AsyncClient(base_url=mock.base_url, timeout=30) as http,
    ):
        engine = mock.engine
        body = {
            "token_ids": PROMPT,
            "sampling_params": {"max_tokens": 1500, "ignore_eos": True, "n": 2},
            "request_id": "long",
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with http.stream("POST", PATH, json=body) as r:
            lines = r.aiter_lines()
            [first] = await _data(lines, first_only=True)
            request_id = first["request_id"]
            assert request_id == "generate-tokens-long"
            assert engine.scheduler.num_running == 2

            # The client's own id is not the server's: it names nothing, as an unknown id does.
            r2 = await http.post("/inference/v1/abort_requests", json={"request_ids": ["long", "nope"]})
            assert r2.status_code == 200 and r2.content == b""
            assert engine.scheduler.num_running == 2

            r3 = await http.post("/inference/v1/abort_requests", json={"request_ids": [request_id]})
            assert r3.status_code == 200
            rest = await _data(lines)
        assert rest[-1] == "[DONE]"
        *chunks, usage_event = rest[:-1]
        reasons: dict[int, str | None] = {}
        for event in [first, *chunks]:
            [choice] = event["choices"]
            reasons[choice["index"]] = choice["finish_reason"]
        assert reasons == {0: "abort", 1: "abort"}  # (each choice's last event says so)
        made = sum(len(c["token_ids"]) for e in [first, *chunks] for c in e["choices"])
        assert usage_event["choices"] == [] and usage_event["usage"]["completion_tokens"] == made < 3000
        await wait_idle(engine)
        assert engine.pool.num_used == 0
        metrics = (await http.get("/metrics")).text
        assert metric(metrics, 'vllm:request_success_total{finished_reason="abort",') == 2


async def test_the_legacy_abort_path_ends_a_whole_answer_with_abort() -> None:
    async with (
        run_mock(block_size=BS, num_blocks=256, speedup=5) as mock,
        httpx.AsyncClient(base_url=mock.base_url, timeout=30) as http,
    ):
        engine = mock.engine
        body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 1500, "ignore_eos": True}}
        waiting = asyncio.create_task(http.post(PATH, json=body, headers={"X-Request-Id": "w"}))
        while engine.scheduler.num_running == 0:
            await asyncio.sleep(0.005)
        r = await http.post("/abort_requests", json={"request_ids": "generate-tokens-w"})
        assert r.status_code == 200
        answer = (await waiting).json()
        assert answer["request_id"] == "generate-tokens-w"
        [choice] = answer["choices"]
        assert choice["finish_reason"] == "abort"
        assert len(choice["token_ids"]) == answer["usage"]["completion_tokens"] < 1500
        await wait_idle(engine)
        assert engine.pool.num_used == 0


@pytest.mark.parametrize("path", ["/inference/v1/abort_requests", "/abort_requests"])
async def test_an_abort_without_request_ids_is_a_400(path: str) -> None:
    async with run_mock(speedup=20) as mock, httpx.AsyncClient(base_url=mock.base_url) as http:
        for body, field in (({}, "request_ids"), ({"request_ids": [1]}, "request_ids"), ([], "body")):
            r = await http.post(path, json=body)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == field
        bad = await http.post(path, content=b"{not json")
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "body"


async def test_a_client_disconnect_aborts_the_request() -> None:
    async with (
        run_mock(block_size=BS, num_blocks=256, speedup=5) as mock,
        httpx.AsyncClient(base_url=mock.base_url) as http,
    ):
        engine = mock.engine
        body = {
            "token_ids": PROMPT,
            "sampling_params": {"max_tokens": 1500, "ignore_eos": True},
            "stream": True,
        }
        async with http.stream("POST", PATH, json=body) as r:
            assert (await anext(r.aiter_lines())).startswith("data: ")
            assert engine.scheduler.num_running == 1
        await wait_idle(engine)
        assert engine.pool.num_used == 0
