"""The mock's ``POST /v1/embeddings``, over HTTP against a running mock: vLLM's shapes, a vector
that depends on the token ids alone, a prefill's cost on the engine, its errors naming the field."""

from __future__ import annotations

import asyncio
import base64
import math
import struct
from typing import Any

import httpx
import openai
import pytest

from kvmesh.mock.testing import run_mock
from kvmesh.mock.timing import prefill_ms
from kvmesh.router.request.tokenizer import BuiltinTokenizer
from tests.mock.test_server import metric, wait_idle

pytestmark = pytest.mark.e2e

MODEL = "kvmesh-mock"
PATH = "/v1/embeddings"
SIZE = 32  # the mock model's vector size
TOKENS = BuiltinTokenizer().encode


async def _embed(http: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    r = await http.post(PATH, json=body)
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


def _vectors(answer: dict[str, Any]) -> list[Any]:
    """Each input's ``embedding``: a list of floats, or a base64 string."""
    return [item["embedding"] for item in answer["data"]]


def _norm(vector: list[float]) -> float:
    return math.sqrt(sum(x * x for x in vector))


@pytest.mark.parametrize(
    ("given", "as_ids"),
    [
        pytest.param("The quick brown fox", [TOKENS("The quick brown fox")], id="string"),
        pytest.param(["alpha beta", "gamma"], [TOKENS("alpha beta"), TOKENS("gamma")], id="strings"),
        pytest.param([5000, 5001, 5002], [[5000, 5001, 5002]], id="token-ids"),
        pytest.param([[7, 8, 9, 10], [11]], [[7, 8, 9, 10], [11]], id="token-id-lists"),
    ],
)
async def test_each_input_shape_is_embedded_in_order_with_its_usage(
    given: Any, as_ids: list[list[int]]
) -> None:
    async with (
        run_mock(block_size=16, num_blocks=64, speedup=50, events=False) as mock,
        httpx.AsyncClient(base_url=mock.base_url) as http,
    ):
        answer = await _embed(http, model=MODEL, input=given)
        assert answer["object"] == "list" and answer["model"] == MODEL
        assert answer["id"].startswith("embd-") and isinstance(answer["created"], int)
        assert [(d["index"], d["object"]) for d in answer["data"]] == [
            (i, "embedding") for i in range(len(as_ids))
        ]
        for vector in _vectors(answer):
            assert len(vector) == SIZE and _norm(vector) == pytest.approx(1.0, abs=1e-6)
        total = sum(len(ids) for ids in as_ids)
        assert answer["usage"]["prompt_tokens"] == answer["usage"]["total_tokens"] == total
        assert answer["usage"]["completion_tokens"] == 0
        # A text's vector is its tokens' (tokenized as a completion's prompt is), one by one.
        by_ids = await _embed(http, input=as_ids)
        assert _vectors(by_ids) == _vectors(answer)
        one_by_one = [_vectors(await _embed(http, input=ids))[0] for ids in as_ids]
        assert one_by_one == _vectors(answer)
        if len(as_ids) > 1:
            assert _vectors(answer)[0] != _vectors(answer)[1]


async def test_base64_is_the_same_vector_as_float32_bytes() -> None:
    async with (
        run_mock(block_size=16, num_blocks=64, speedup=50, events=False) as mock,
        httpx.AsyncClient(base_url=mock.base_url) as http,
    ):
        inputs = ["one input", "another input"]
        floats = _vectors(await _embed(http, input=inputs))
        encoded = _vectors(await _embed(http, input=inputs, encoding_format="base64"))
        assert all(isinstance(e, str) for e in encoded)
        assert [list(struct.unpack(f"<{SIZE}f", base64.b64decode(e))) for e in encoded] == floats
        big = _vectors(await _embed(http, input=inputs, encoding_format="base64", endianness="big"))
        assert [list(struct.unpack(f">{SIZE}f", base64.b64decode(e))) for e in big] == floats

        # The OpenAI client asks for base64 by default and decodes it itself.
        async with openai.AsyncOpenAI(
            base_url=mock.base_url + "/v1", api_key="unused", max_retries=0
        ) as client:
            got = await client.embeddings.create(model=MODEL, input=inputs)
            assert [d.embedding for d in got.data] == floats
            assert got.usage.prompt_tokens == sum(len(TOKENS(t)) for t in inputs)
            cut = await client.embeddings.create(model=MODEL, input=inputs, dimensions=8)
            assert [len(d.embedding) for d in cut.data] == [8, 8]


async def test_dimensions_cut_the_vector_which_is_then_normalised() -> None:
    async with (
        run_mock(block_size=16, num_blocks=64, speedup=50, events=False) as mock,
        httpx.AsyncClient(base_url=mock.base_url) as http,
    ):
        raw = _vectors(await _embed(http, input="matryoshka", use_activation=False))[0]
        assert len(raw) == SIZE and _norm(raw) != pytest.approx(1.0)
        raw_cut = _vectors(await _embed(http, input="matryoshka", use_activation=False, dimensions=8))[0]
        assert raw_cut == raw[:8]
        cut = _vectors(await _embed(http, input="matryoshka", dimensions=8))[0]
        assert len(cut) == 8 and _norm(cut) == pytest.approx(1.0, abs=1e-6)
        assert cut == pytest.approx([x / _norm(raw[:8]) for x in raw[:8]], rel=1e-6)
        whole = _vectors(await _embed(http, input="matryoshka", dimensions=SIZE))[0]
        assert whole == _vectors(await _embed(http, input="matryoshka"))[0]


async def test_the_same_input_has_the_same_vector_on_every_engine() -> None:
    async with (
        run_mock(block_size=16, num_blocks=64, speedup=50, seed=1, events=False) as one,
        run_mock(block_size=32, num_blocks=128, speedup=10, seed=2, events=False) as other,
        httpx.AsyncClient(base_url=one.base_url) as http_one,
        httpx.AsyncClient(base_url=other.base_url) as http_other,
    ):
        inputs = ["a document about caches", "a query", [3, 1, 4, 1, 5]]
        first = _vectors(await _embed(http_one, input=inputs[:2])) + _vectors(
            await _embed(http_one, input=[inputs[2]])
        )
        second = _vectors(await _embed(http_other, input=inputs[:2])) + _vectors(
            await _embed(http_other, input=[inputs[2]])
        )
        assert first == second
        assert len({tuple(v) for v in first}) == 3


async def test_an_input_costs_its_prefill_and_the_time_scales_with_speedup() -> None:
    text = "embed this passage of a document " * 10
    n = len(TOKENS(text))
    modelled = []
    for speedup in (10.0, 40.0):
        async with (
            run_mock(block_size=16, num_blocks=64, speedup=speedup, events=False) as mock,
            httpx.AsyncClient(base_url=mock.base_url) as http,
        ):
            await _embed(http, input=text)
            assert mock.engine.modelled_seconds >= prefill_ms(n) / 1000 / speedup
            modelled.append(mock.engine.modelled_seconds * speedup)
            metrics = (await http.get("/metrics")).text
            assert metric(metrics, "vllm:prompt_tokens_total") == n
            assert metric(metrics, "vllm:prefix_cache_queries_total") == n
            assert mock.engine.pool.num_used == 0  # (the request ended, its blocks given back)
    assert modelled[0] == pytest.approx(modelled[1])


async def test_a_repeated_long_input_is_served_from_the_prefix_cache_as_a_completion_is() -> None:
    text = "a long shared preamble that many requests repeat " * 12
    n = len(TOKENS(text))
    cached = (n - 1) // 16 * 16  # every full block but the one holding the last token
    assert cached >= 64
    async with (
        run_mock(block_size=16, num_blocks=256, speedup=50, events=False) as mock,
        httpx.AsyncClient(base_url=mock.base_url) as http,
    ):
        await _embed(http, input=text)
        assert metric((await http.get("/metrics")).text, "vllm:prefix_cache_hits_total") == 0
        await _embed(http, input=text)
        metrics = (await http.get("/metrics")).text
        assert metric(metrics, "vllm:prefix_cache_hits_total") == cached
        assert metric(metrics, "vllm:prompt_tokens_total") == 2 * n - cached
        # The embedded prompt's blocks serve a completion of the same prompt too.
        r = await http.post("/v1/completions", json={"prompt": text, "max_tokens": 1})
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == cached


async def test_truncate_prompt_tokens_keeps_the_side_asked_and_max_model_len_fits() -> None:
    long = [100 + i for i in range(200)]
    async with (
        run_mock(block_size=16, num_blocks=64, max_model_len=64, speedup=50, events=False) as mock,
        httpx.AsyncClient(base_url=mock.base_url) as http,
    ):
        whole = await _embed(http, input=long, truncate_prompt_tokens=-1)  # (max_model_len tokens)
        assert whole["usage"]["prompt_tokens"] == 64
        assert _vectors(whole) == _vectors(await _embed(http, input=long[:64]))
        left = await _embed(http, input=long, truncate_prompt_tokens=10, truncation_side="left")
        assert left["usage"]["prompt_tokens"] == 10
        assert _vectors(left) == _vectors(await _embed(http, input=long[-10:]))
        right = await _embed(http, input=long, truncate_prompt_tokens=10)
        assert _vectors(right) == _vectors(await _embed(http, input=long[:10]))


LONG = [100 + i for i in range(65)]  # one token past the max_model_len of 64 below


@pytest.mark.parametrize(
    ("body", "status", "param", "message"),
    [
        pytest.param([], 400, "body", "JSON object", id="body"),
        pytest.param({}, 400, "input", "required", id="no-input"),
        pytest.param({"input": []}, 400, "input", "non-empty", id="empty-list"),
        pytest.param({"input": ""}, 400, "input", "empty", id="empty-string"),
        pytest.param({"input": ["a", ""]}, 400, "input", "item 1 is empty", id="empty-item"),
        pytest.param({"input": [[]]}, 400, "input", "empty", id="empty-ids"),
        pytest.param({"input": [5, -1]}, 400, "input", "token ids", id="negative-id"),
        pytest.param({"input": [[5], [2**31]]}, 400, "input", "item 1", id="id-too-big"),
        pytest.param({"input": ["a", [1, 2]]}, 400, "input", "mix", id="mixed"),
        pytest.param({"input": 5}, 400, "input", "must be", id="number"),
        pytest.param({"input": [{"role": "user", "content": "x"}]}, 400, "input", "chat", id="chat-input"),
        pytest.param({"input": LONG}, 400, "input", "maximum context length is 64", id="too-long"),
        pytest.param({"input": [[1], LONG]}, 400, "input", "item 1 has 65", id="too-long-item"),
        pytest.param({"input": "x", "dimensions": 0}, 400, "dimensions", "at least 1", id="dimensions-0"),
        pytest.param({"input": "x", "dimensions": 33}, 400, "dimensions", "[1, 32]", id="dimensions-over"),
        pytest.param({"input": "x", "dimensions": 4.0}, 400, "dimensions", "integer", id="dimensions-float"),
        pytest.param({"input": "x", "dimensions": True}, 400, "dimensions", "integer", id="dimensions-bool"),
        pytest.param(
            {"input": "x", "encoding_format": "binary"}, 400, "encoding_format", "'float'", id="format"
        ),
        pytest.param(
            {"input": "x", "encoding_format": "bytes"},
            400,
            "encoding_format",
            "not supported",
            id="format-bytes",
        ),
        pytest.param({"input": "x", "endianness": "middle"}, 400, "endianness", "one of", id="endianness"),
        pytest.param({"input": "x", "embed_dtype": "float16"}, 400, "embed_dtype", "float32", id="dtype"),
        pytest.param({"input": "x", "model": "gpt-4"}, 404, "model", "does not exist", id="model"),
        pytest.param({"input": "x", "priority": 1}, 400, "priority", "--scheduling-policy", id="priority"),
        pytest.param({"input": "x", "priority": "high"}, 400, "priority", "integer", id="priority-type"),
        pytest.param(
            {"input": "x", "truncate_prompt_tokens": 65},
            400,
            "truncate_prompt_tokens",
            "at most",
            id="truncate",
        ),
        pytest.param(
            {"input": "x", "truncate_prompt_tokens": -2},
            400,
            "truncate_prompt_tokens",
            "at least",
            id="truncate-neg",
        ),
        pytest.param({"input": "x", "truncation_side": "up"}, 400, "truncation_side", "'left'", id="side"),
        pytest.param({"input": "x", "normalize": True}, 400, "normalize", "use_activation", id="normalize"),
        pytest.param(
            {"input": "x", "use_activation": "yes"}, 400, "use_activation", "boolean", id="activation"
        ),
        pytest.param({"input": "x", "user": 5}, 400, "user", "string", id="user"),
        pytest.param({"input": "x", "cache_salt": "s"}, 400, "cache_salt", "not supported", id="cache-salt"),
        pytest.param(
            {"messages": [{"role": "user", "content": "x"}]}, 400, "messages", "chat", id="messages"
        ),
    ],
)
async def test_a_bad_request_is_a_4xx_naming_its_field_and_runs_nothing(
    body: Any, status: int, param: str, message: str
) -> None:
    async with (
        run_mock(block_size=16, num_blocks=64, max_model_len=64, events=False) as mock,
        httpx.AsyncClient(base_url=mock.base_url) as http,
    ):
        r = await http.post(PATH, json=body)
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert error["param"] == param and error["code"] == status
        assert message in error["message"]
        assert mock.engine.steps == 0 and not mock.engine.scheduler.has_work


async def test_inputs_show_on_the_engine_while_they_run_and_a_client_that_leaves_aborts_them() -> None:
    # Slowed down so that one prefill outlasts the test's look at the engine by far.
    async with (
        run_mock(block_size=16, num_blocks=64, max_num_seqs=1, speedup=0.001, events=False) as mock,
        httpx.AsyncClient(base_url=mock.base_url) as http,
    ):
        engine = mock.engine
        inputs = ["first input " * 8, "second input " * 8, "third input " * 8]
        asking = asyncio.ensure_future(http.post(PATH, json={"input": inputs}))
        deadline = asyncio.get_running_loop().time() + 10
        while engine.scheduler.num_running + engine.scheduler.num_waiting < 3:
            assert asyncio.get_running_loop().time() < deadline, "the inputs never reached the engine"
            await asyncio.sleep(0.01)
        async with httpx.AsyncClient(base_url=mock.base_url) as watcher:
            metrics = (await watcher.get("/metrics")).text
        assert metric(metrics, "vllm:num_requests_running") == 1  # (max_num_seqs 1: one at a time)
        assert metric(metrics, "vllm:num_requests_waiting") == 2
        assert not asking.done()

        asking.cancel()  # the client hangs up before the answer
        with pytest.raises(asyncio.CancelledError):
            await asking
        await wait_idle(engine)
        assert engine.pool.num_used == 0
        async with httpx.AsyncClient(base_url=mock.base_url) as watcher:
            metrics = (await watcher.get("/metrics")).text
        assert metric(metrics, 'vllm:request_success_total{finished_reason="abort",') == 3
