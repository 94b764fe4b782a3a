"""A batch of prompts in one request on the mock engine, driven over HTTP on loopback.

The mock serves it as the engines do: each prompt a request of its own, every prompt checked before
any runs, and one answer in the engine's batch shape. ``/v1/completions`` (vLLM 0.33.0): one
completion, its ``choices`` numbered ``prompt * n + choice``, the usage summed; streamed, every
prompt's chunks under one id, the summed usage chunk once before ``[DONE]``. ``/generate`` (SGLang
0.5.23): a list of results in prompt order, a string ``rid`` numbered ``rid_0``, ``rid_1``, ...;
streamed, each event one prompt's answer so far with its ``index`` among all the samples.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import httpx
import openai
import pytest

from kvmesh.mock.testing import run_mock
from kvmesh.router.request.tokenizer import BuiltinTokenizer
from tests.mock.test_generate import _events
from tests.mock.test_server import MODEL, metric, wait_idle

pytestmark = pytest.mark.e2e

A = "The quick brown fox jumps over the lazy dog, then naps in the warm afternoon sun. " * 3
B = "A second prompt, about something else entirely: the tides and the moon."
BS = 16


async def _wait_running(engine: Any, count: int, timeout: float = 5.0) -> None:
    """Until ``count`` engine requests are running."""
    deadline = asyncio.get_running_loop().time() + timeout
    while engine.scheduler.num_running != count:
        assert asyncio.get_running_loop().time() < deadline, f"{engine.scheduler.num_running} running"
        await asyncio.sleep(0.005)


async def test_a_generate_batch_is_a_list_of_each_prompts_results_in_order() -> None:
    async with (
        run_mock(block_size=BS, num_blocks=256, speedup=20) as mock,
        httpx.AsyncClient(base_url=mock.base_url) as http,
    ):
        params = [{"max_new_tokens": 3, "ignore_eos": True}, {"max_new_tokens": 2, "ignore_eos": True}]
        singles = [
            (await http.post("/generate", json={"text": text, "sampling_params": p})).json()
            for text, p in zip((A, B), params, strict=True)
        ]
        r = await http.post("/generate", json={"text": [A, B], "rid": "b", "sampling_params": params})
        assert r.status_code == 200, r.text
        answers = r.json()
        assert isinstance(answers, list) and len(answers) == 2
        # SGLang's numbering of a string rid; each prompt's own sampling parameters.
        assert [a["meta_info"]["id"] for a in answers] == ["b_0", "b_1"]
        assert [a["meta_info"]["completion_tokens"] for a in answers] == [3, 2]
        assert [a["text"] for a in answers] == [s["text"] for s in singles]
        assert [a["meta_info"]["prompt_tokens"] for a in answers] == [
            len(BuiltinTokenizer().encode(t)) for t in (A, B)
        ]

        # Token-id prompts, a rid each, one set of parameters for both.
        ids = [list(range(300, 340)), list(range(500, 510))]
        body = {"input_ids": ids, "rid": ["p", "q"], "sampling_params": {"max_new_tokens": 2}}
        by_ids = (await http.post("/generate", json=body)).json()
        assert [a["meta_info"]["id"] for a in by_ids] == ["p", "q"]
        assert [a["meta_info"]["prompt_tokens"] for a in by_ids] == [40, 10]

        # n samples a prompt: n results each, prompt by prompt.
        sampled = {"max_new_tokens": 3, "ignore_eos": True, "n": 2}
        each = [
            (await http.post("/generate", json={"text": text, "sampling_params": sampled})).json()
            for text in (A, B)
        ]
        both = (await http.post("/generate", json={"text": [A, B], "sampling_params": sampled})).json()
        assert len(both) == 4 and all("index" not in a for a in both)
        assert [a["text"] for a in both] == [a["text"] for answers in each for a in answers]
        await wait_idle(mock.engine)
        assert mock.engine.pool.num_used == 0


async def test_a_streamed_generate_batch_numbers_its_events_across_prompts() -> None:
    async with (
        run_mock(block_size=BS, num_blocks=256, speedup=20) as mock,
        httpx.AsyncClient(base_url=mock.base_url) as http,
    ):
        sampled = {"max_new_tokens": 6, "ignore_eos": True, "n": 2}
        whole = (await http.post("/generate", json={"text": [A, B], "sampling_params": sampled})).json()
        body = {"text": [A, B], "sampling_params": sampled, "stream": True}
        async with http.stream("POST", "/generate", json=body) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            events = _events((await r.aread()).decode())
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        answers = events[:-1]
        by_index: dict[int, list[Any]] = {}
        for event in answers:
            by_index.setdefault(event["index"], []).append(event)
        assert sorted(by_index) == [0, 1, 2, 3]  # (prompt i's sample j is i * 2 + j)
        for index, own in by_index.items():
            for before, after in itertools.pairwise(own):  # (each event the answer whole so far)
                assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
            assert own[-1]["text"] == whole[index]["text"]
            assert own[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
        # The prompts' events are interleaved as they come, not one prompt's after the other's.
        positions = {i: [k for k, e in enumerate(answers) if e["index"] == i] for i in by_index}
        assert positions[2][0] < positions[0][-1]


async def test_a_completions_batch_is_one_completion_numbered_prompt_by_prompt() -> None:
    async with (
        run_mock(block_size=BS, num_blocks=256, speedup=20) as mock,
        openai.AsyncOpenAI(base_url=mock.base_url + "/v1", api_key="unused", max_retries=0) as client,
    ):
        ids = list(range(300, 330))
        singles = [
            await client.completions.create(model=MODEL, prompt=p, max_tokens=3, n=2) for p in (A, ids)
        ]
        batch = await client.completions.create(model=MODEL, prompt=[A, ids], max_tokens=3, n=2)
        assert batch.object == "text_completion"
        assert [c.index for c in batch.choices] == [0, 1, 2, 3]
        assert [c.text for c in batch.choices] == [c.text for s in singles for c in s.choices]
        assert batch.usage is not None
        prompt_tokens = [s.usage.prompt_tokens for s in singles if s.usage is not None]
        assert batch.usage.prompt_tokens == sum(prompt_tokens) == len(BuiltinTokenizer().encode(A)) + 30
        assert batch.usage.completion_tokens == 12
        assert batch.usage.total_tokens == sum(prompt_tokens) + 12

        # A list of one prompt is that prompt.
        one = await client.completions.create(model=MODEL, prompt=[B], max_tokens=2)
        assert len(one.choices) == 1 and one.usage is not None and one.usage.completion_tokens == 2


async def test_a_streamed_completions_batch_has_one_id_and_one_summed_usage_chunk() -> None:
    async with (
        run_mock(block_size=BS, num_blocks=256, speedup=20) as mock,
        httpx.AsyncClient(base_url=mock.base_url) as http,
    ):
        body: dict[str, Any] = {"prompt": [A, B], "max_tokens": 5, "n": 2, "ignore_eos": True}
        whole = (await http.post("/v1/completions", json=body)).json()
        streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
        async with http.stream("POST", "/v1/completions", json=streamed) as r:
            assert r.status_code == 200
            events = _events((await r.aread()).decode())
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        *chunks, usage = events[:-1]
        assert len({c["id"] for c in [*chunks, usage]}) == 1
        text: dict[int, str] = {}
        for chunk in chunks:
            (choice,) = chunk["choices"]
            text[choice["index"]] = text.get(choice["index"], "") + choice["text"]
        assert sorted(text) == [0, 1, 2, 3]
        assert [text[i] for i in range(4)] == [c["text"] for c in whole["choices"]]
        assert usage["choices"] == []
        assert usage["usage"]["completion_tokens"] == 20
        assert usage["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"]
        assert usage["usage"]["total_tokens"] == whole["usage"]["prompt_tokens"] + 20


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        pytest.param("/generate", {"text": [A, B], "sampling_params": [{}]}, "sampling_params", id="params"),
        pytest.param("/generate", {"text": [A, B], "rid": ["x"]}, "rid", id="rid"),
        pytest.param("/generate", {"text": [A, 5]}, "text[1]", id="text-kind"),
        pytest.param("/generate", {"input_ids": [[1, 2], [3, "4"]]}, "input_ids[1]", id="ids-kind"),
        pytest.param("/generate", {"text": []}, "text", id="empty"),
        pytest.param(
            "/generate",
            {"text": [A, B], "sampling_params": [{}, {"max_new_tokens": 0}]},
            "sampling_params[1].max_new_tokens",
            id="prompt-params",
        ),
        pytest.param(
            "/generate",
            {"text": [A, B], "return_logprob": [False, True]},
            "return_logprob[1]",
            id="per-prompt",
        ),
        pytest.param(
            "/generate",
            {"text": [A, B], "sampling_params": {"regex": "a+"}},
            "sampling_params.regex",
            id="shared",
        ),
        pytest.param("/v1/completions", {"prompt": [A, 5]}, "prompt[1]", id="prompt-kind"),
        pytest.param("/v1/completions", {"prompt": [A, "word " * 400]}, "prompt[1]", id="too-long"),
        pytest.param("/v1/completions", {"prompt": [A, B], "max_tokens": 0}, "max_tokens", id="max-tokens"),
    ],
)
async def test_one_bad_prompt_fails_the_batch_before_any_prompt_runs(
    monkeypatch: pytest.MonkeyPatch, path: str, body: dict[str, Any], field: str
) -> None:
    async with (
        run_mock(block_size=BS, num_blocks=256, max_model_len=256, speedup=20) as mock,
        httpx.AsyncClient(base_url=mock.base_url) as http,
    ):
        submitted: list[str | None] = []
        submit = mock.engine.submit

        def counted(params: Any, request_id: str | None = None) -> Any:
            submitted.append(request_id)
            return submit(params, request_id)

        monkeypatch.setattr(mock.engine, "submit", counted)
        r = await http.post(path, json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field
        assert submitted == []  # (every prompt is checked before any reaches the engine)
        good = {"text": [A, B]} if path == "/generate" else {"prompt": [A, B], "max_tokens": 2}
        ok = await http.post(path, json=good)
        assert ok.status_code == 200, ok.text
        assert len(submitted) == 2


@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
async def test_a_client_leaving_a_batch_leaves_nothing_running(path: str) -> None:
    async with (
        run_mock(block_size=BS, num_blocks=256, speedup=5) as mock,
        httpx.AsyncClient(base_url=mock.base_url) as http,
    ):
        engine = mock.engine
        if path == "/generate":
            body: dict[str, Any] = {"text": [A, B], "sampling_params": {"max_new_tokens": 1500, "n": 2}}
        else:
            body = {"prompt": [A, B], "max_tokens": 1500, "n": 2}
        async with http.stream("POST", path, json={**body, "stream": True}) as r:
            lines = r.aiter_lines()
            assert (await anext(lines)).startswith("data: ")
            await _wait_running(engine, 4)  # (each prompt's every sample an engine request)
        await wait_idle(engine)
        assert engine.pool.num_used == 0

        # A whole answer's client giving up stops every prompt's requests too.
        with pytest.raises(httpx.ReadTimeout):
            await http.post(path, json=body, timeout=0.3)
        await wait_idle(engine)
        assert engine.pool.num_used == 0
        text = (await http.get("/metrics")).text
        assert metric(text, 'vllm:request_success_total{finished_reason="abort",') == 8


async def test_an_abort_of_one_prompts_rid_stops_that_prompt_only() -> None:
    async with (
        run_mock(block_size=BS, num_blocks=256, speedup=5) as mock,
        httpx.AsyncClient(base_url=mock.base_url) as http,
    ):
        params = [{"max_new_tokens": 40, "ignore_eos": True}, {"max_new_tokens": 1500, "ignore_eos": True}]
        body = {"text": [A, B], "rid": "b", "sampling_params": params}
        whole = asyncio.ensure_future(http.post("/generate", json=body))
        await _wait_running(mock.engine, 2)
        aborted = await http.post("/abort_request", json={"rid": "b_1"})
        assert aborted.status_code == 200
        r = await whole
        assert r.status_code == 200, r.text
        first, second = r.json()
        assert first["meta_info"]["id"] == "b_0"
        assert first["meta_info"]["finish_reason"] == {"type": "length", "length": 40}
        assert second["meta_info"]["id"] == "b_1"
        assert second["meta_info"]["finish_reason"]["type"] == "abort"
        assert second["meta_info"]["completion_tokens"] < 1500

        # Streamed: the aborted prompt's last event says so, the other goes on to its end.
        stream = {**body, "stream": True}
        async with http.stream("POST", "/generate", json=stream) as s:
            await _wait_running(mock.engine, 2)
            await http.post("/abort_request", json={"rid": "b_1"})
            events = _events((await s.aread()).decode())
        assert events[-1] == "[DONE]"
        last = {e["index"]: e for e in events[:-1]}
        assert last[0]["meta_info"]["finish_reason"] == {"type": "length", "length": 40}
        assert last[1]["meta_info"]["finish_reason"]["type"] == "abort"
        await wait_idle(mock.engine)
        assert mock.engine.pool.num_used == 0


async def test_a_chat_batch_is_one_chat_completion_a_choice_per_conversation() -> None:
    """vLLM 0.33.0's ``/v1/chat/completions/batch``: each conversation a chat request, answered
    whole; a conversation the engine refuses fails the batch before any runs."""
    async with (
        run_mock(block_size=BS, num_blocks=256, speedup=20) as mock,
        httpx.AsyncClient(base_url=mock.base_url) as http,
    ):
        conversations = [[{"role": "user", "content": A}], [{"role": "user", "content": B}]]
        body = {"model": MODEL, "max_tokens": 3, "ignore_eos": True}
        singles = [
            (await http.post("/v1/chat/completions", json={**body, "messages": c})).json()
            for c in conversations
        ]
        r = await http.post("/v1/chat/completions/batch", json={**body, "messages": conversations})
        assert r.status_code == 200, r.text
        answer = r.json()
        assert answer["object"] == "chat.completion"
        assert [c["index"] for c in answer["choices"]] == [0, 1]
        assert [c["message"]["content"] for c in answer["choices"]] == [
            s["choices"][0]["message"]["content"] for s in singles
        ]
        assert answer["usage"]["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in singles)
        assert answer["usage"]["completion_tokens"] == 6
        for bad, field in (
            ({"messages": [conversations[0], [{"role": "user", "content": 7}]]}, "messages[1][0].content"),
            ({"messages": conversations, "stream": True}, "stream"),
            ([1, 2], "body"),
        ):
            r = await http.post(
                "/v1/chat/completions/batch", json={**body, **bad} if isinstance(bad, dict) else bad
            )
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
            if field.endswith("content"):
                assert r.json()["error"]["message"].startswith("conversation 1 of the batch: "), r.text
        await wait_idle(mock.engine)
        metrics = (await http.get("/metrics")).text
        assert metric(metrics, "vllm:request_success_total") == 4  # (the two singles and the batch's two)
