"""The mock's SGLang-native ``/generate`` (POST and PUT), driven over HTTP on loopback.

The mock answers as SGLang 0.5.23 does: ``{"text", "output_ids", "meta_info"}`` (a list of them for
``n`` > 1), ``meta_info`` with the token counts and the engine's real prefix-cache hit; a stream of
``data:`` events, each the answer whole so far (SGLang's default), then ``data: [DONE]``.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import httpx
import pytest

from kvmesh.mock.testing import run_mock
from kvmesh.router.request.tokenizer import BuiltinTokenizer
from tests.mock.test_server import metric, wait_idle

pytestmark = pytest.mark.e2e

TEXT = "The quick brown fox jumps over the lazy dog, then naps in the warm afternoon sun. " * 3
BS = 16


def _events(raw: str) -> list[Any]:
    """The stream's ``data:`` payloads, ``[DONE]`` kept as the string."""
    parts = raw.split("\n\n")
    assert parts[-1] == ""
    out = []
    for part in parts[:-1]:
        assert part.startswith("data: "), part
        data = part.removeprefix("data: ")
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def test_a_whole_answer_counts_the_prompt_and_its_cached_blocks() -> None:
    async with (
        run_mock(block_size=BS, num_blocks=256, speedup=20) as mock,
        httpx.AsyncClient(base_url=mock.base_url) as http,
    ):
        body = {"text": TEXT, "rid": "r-1", "sampling_params": {"max_new_tokens": 7, "ignore_eos": True}}
        r = await http.post("/generate", json=body)
        assert r.status_code == 200
        first = r.json()
        assert set(first) == {"text", "output_ids", "meta_info"}
        meta = first["meta_info"]
        prompt_len = len(BuiltinTokenizer().encode(TEXT))
        assert meta["id"] == "r-1"
        assert meta["prompt_tokens"] == prompt_len
        assert meta["completion_tokens"] == 7 == len(first["output_ids"])
        assert meta["finish_reason"] == {"type": "length", "length": 7}
        assert meta["cached_tokens"] == 0
        assert meta["e2e_latency"] > 0
        assert first["text"] == BuiltinTokenizer().decode(first["output_ids"])

        # The same request again (PUT, which SGLang takes too): the prompt's whole blocks are cached.
        del body["rid"]
        again = (await http.put("/generate", json=body)).json()
        assert again["meta_info"]["cached_tokens"] == (prompt_len - 1) // BS * BS > 0
        assert again["text"] == first["text"]  # (the mock is deterministic)
        assert len(again["meta_info"]["id"]) == 32 and again["meta_info"]["id"] != "r-1"

        # A prompt of token ids is taken as it is; max_new_tokens left out is SGLang's 128.
        ids = list(range(300, 340))
        by_ids = (await http.post("/generate", json={"input_ids": ids})).json()
        assert by_ids["meta_info"]["prompt_tokens"] == len(ids)
        assert by_ids["meta_info"]["completion_tokens"] == 128
        with_prompt = (
            await http.post(
                "/generate",
                json={
                    "input_ids": ids,
                    "return_prompt_token_ids": True,
                    "sampling_params": {"max_new_tokens": 1},
                },
            )
        ).json()
        assert with_prompt["prompt_token_ids"] == ids


async def test_a_stream_is_cumulative_and_ends_with_done() -> None:
    async with (
        run_mock(block_size=BS, num_blocks=256, speedup=20) as mock,
        httpx.AsyncClient(base_url=mock.base_url) as http,
    ):
        params = {"max_new_tokens": 9, "ignore_eos": True, "sampling_seed": 11}
        whole = (await http.post("/generate", json={"text": TEXT, "sampling_params": params})).json()
        async with http.stream(
            "POST", "/generate", json={"text": TEXT, "sampling_params": params, "stream": True}
        ) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            events = _events((await r.aread()).decode())
        assert events[-1] == "[DONE]"
        answers = events[:-1]
        assert len(answers) >= 2  # (one event a step at least)
        for before, after in itertools.pairwise(answers):
            # Each event is the answer whole so far: it begins with the one before.
            assert after["text"].startswith(before["text"])
            assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
            assert before["meta_info"]["finish_reason"] is None
            assert "e2e_latency" not in before["meta_info"]
        assert all("index" not in a for a in answers)  # (n = 1)
        last = answers[-1]
        assert last["text"] == whole["text"] and last["output_ids"] == whole["output_ids"]
        meta = last["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": 9}
        assert meta["completion_tokens"] == 9
        assert meta["prompt_tokens"] == whole["meta_info"]["prompt_tokens"]
        assert meta["cached_tokens"] == (meta["prompt_tokens"] - 1) // BS * BS
        assert meta["e2e_latency"] > 0


async def test_n_samples_are_a_list_and_streamed_events_carry_their_index() -> None:
    async with (
        run_mock(block_size=BS, num_blocks=256, speedup=20) as mock,
        httpx.AsyncClient(base_url=mock.base_url) as http,
    ):
        params = {"max_new_tokens": 4, "ignore_eos": True}
        one = (await http.post("/generate", json={"text": TEXT, "sampling_params": params})).json()
        r = await http.post(
            "/generate", json={"text": TEXT, "rid": "x", "sampling_params": {**params, "n": 2}}
        )
        answers = r.json()
        assert isinstance(answers, list) and len(answers) == 2
        # In sample order, with no index (SGLang puts none outside a stream) and an id each.
        assert all("index" not in a and a["meta_info"]["completion_tokens"] == 4 for a in answers)
        assert answers[0]["text"] == one["text"] != answers[1]["text"]
        assert len({a["meta_info"]["id"] for a in answers}) == 2

        body = {"text": TEXT, "sampling_params": {**params, "n": 2}, "stream": True}
        async with http.stream("POST", "/generate", json=body) as s:
            events = _events((await s.aread()).decode())
        assert events[-1] == "[DONE]"
        last: dict[int, Any] = {}
        for event in events[:-1]:
            last[event["index"]] = event
        assert sorted(last) == [0, 1]
        assert [last[i]["text"] for i in (0, 1)] == [a["text"] for a in answers]
        assert all(e["meta_info"]["finish_reason"] == {"type": "length", "length": 4} for e in last.values())


@pytest.mark.parametrize(
    ("body", "field"),
    [
        pytest.param({"sampling_params": {"max_new_tokens": 2}}, "text", id="no-prompt"),
        pytest.param({"text": "x", "sampling_params": [{}, {}]}, "sampling_params", id="batch-params"),
        pytest.param({"input_embeds": [[0.1, 0.2]]}, "input_embeds", id="embeds"),
        pytest.param({"text": "x", "sampling_params": {"regex": "a+"}}, "sampling_params.regex", id="regex"),
        pytest.param({"text": "x", "sampling_params": {"colour": 1}}, "sampling_params.colour", id="unknown"),
        pytest.param(
            {"text": "x", "sampling_params": {"max_new_tokens": 0}},
            "sampling_params.max_new_tokens",
            id="max-new-tokens",
        ),
        pytest.param(
            {"text": "x", "sampling_params": {"min_new_tokens": 5, "max_new_tokens": 2}},
            "sampling_params.min_new_tokens",
            id="min-new-tokens",
        ),
        pytest.param({"text": "x", "return_logprob": True}, "return_logprob", id="logprobs"),
        pytest.param({"text": "x", "cache_salt": "s"}, "cache_salt", id="cache-salt"),
        pytest.param({"text": "x", "rid": ["a", "b"]}, "rid", id="batch-rid"),
        pytest.param({"input_ids": ["a"]}, "input_ids", id="ids-of-text"),
        pytest.param([{"text": "x"}], "body", id="not-an-object"),
    ],
)
async def test_a_body_the_engine_cannot_serve_is_a_400_naming_the_field(body: Any, field: str) -> None:
    async with run_mock(speedup=20) as mock, httpx.AsyncClient(base_url=mock.base_url) as http:
        r = await http.post("/generate", json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field
        bad = await http.post("/generate", content=b"{not json")
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "body"


async def test_sampling_fields_that_change_nothing_here_are_taken() -> None:
    async with run_mock(speedup=20) as mock, httpx.AsyncClient(base_url=mock.base_url) as http:
        params = {
            "max_new_tokens": 2,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 20,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "stop": ["\n"],
            "regex": None,  # (SGLang's defaults of what the mock cannot do ask nothing of it)
            "logit_bias": {},
            "skip_special_tokens": True,
        }
        r = await http.post(
            "/generate", json={"text": "x", "sampling_params": params, "logprob_start_len": 0}
        )
        assert r.status_code == 200, r.text


async def test_a_client_disconnect_aborts_the_request() -> None:
    async with (
        run_mock(block_size=BS, num_blocks=128, speedup=5) as mock,
        httpx.AsyncClient(base_url=mock.base_url) as http,
    ):
        engine = mock.engine
        body = {"text": "tell me a long story " * 20, "sampling_params": {"max_new_tokens": 1500, "n": 2}}
        async with http.stream("POST", "/generate", json={**body, "stream": True}) as r:
            assert (await anext(r.aiter_lines())).startswith("data: ")
            assert engine.scheduler.num_running == 2
        await wait_idle(engine)
        assert engine.pool.num_used == 0

        with pytest.raises(httpx.ReadTimeout):
            await http.post("/generate", json=body, timeout=0.3)
        await wait_idle(engine)
        assert engine.pool.num_used == 0
        metrics = (await http.get("/metrics")).text
        assert metric(metrics, 'vllm:request_success_total{finished_reason="abort",') == 4
