"""Vertex AI's prediction route (SGLang's ``/vertex_generate``, or the path ``AIP_PREDICT_ROUTE``
names) through the router, over HTTP, in front of ``kvmesh mock`` engines, which serve it as SGLang
0.5.23 does.

The body's instances are a ``/generate`` batch: each is routed on its own prefix and served on
``/generate`` at its engine; the answer is SGLang's, ``{"predictions": [...]}`` in instance order."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from kvmesh.commands.demo import start_mesh
from kvmesh.mock.config import MockConfig
from kvmesh.mock.testing import run_mock
from kvmesh.router.core.config import RouterConfig
from kvmesh.router.request.vertex_api import ROUTE_VARIABLE
from tests.mock.test_server import wait_idle
from tests.router.asgi.test_agent_features import BS, mock_fleet
from tests.router.asgi.test_invocations import CONTRACT, MANUAL, completion, warm
from tests.router.asgi.test_responses_api import WORKER
from tests.router.asgi.test_tokens_api import nothing_runs

BRIEF = {"max_new_tokens": 3, "ignore_eos": True}


async def predict(
    http: aiohttp.ClientSession, url: str, body: Any, path: str = "/vertex_generate"
) -> tuple[int, Any, Any]:
    """(status, the answer: JSON, or a stream's events; the answer's headers)."""
    async with http.post(url + path, json=body) as r:
        raw = await r.read()
        if r.content_type == "text/event-stream":
            payloads = [e[len(b"data: ") :] for e in raw.split(b"\n\n") if e.startswith(b"data: ")]
            assert payloads[-1] == b"[DONE]", raw[-300:]
            return r.status, [json.loads(p) for p in payloads[:-1]], r.headers
        return r.status, json.loads(raw), r.headers


def instances(*texts: str) -> list[dict[str, Any]]:
    return [{"text": text} for text in texts]


async def test_each_instance_goes_where_its_prompt_is_cached(http: aiohttp.ClientSession) -> None:
    """Two instances whose prompts are cached on two engines: each is served by its prompt's
    engine, and the predictions come back in instance order. Before, the router answered 404."""
    async with mock_fleet(3) as (front, mocks, app):
        model = mocks[0].config.model
        homes = [mocks[2].base_url, mocks[0].base_url]
        await warm(http, front.url, completion(model, CONTRACT), homes[0])
        await warm(http, front.url, completion(model, MANUAL), homes[1])
        body = {
            "instances": instances(CONTRACT + "Be brief.", MANUAL + "Be brief."),
            "parameters": {"sampling_params": BRIEF, "rid": "job"},
        }
        status, doc, headers = await predict(http, front.url, body)
        assert status == 200, doc
        assert headers[WORKER] == ",".join(homes)
        predictions = doc["predictions"]
        assert [p["meta_info"]["id"] for p in predictions] == ["job_0", "job_1"]  # SGLang's numbering
        for prediction in predictions:
            meta = prediction["meta_info"]
            assert meta["completion_tokens"] == 3
            assert meta["cached_tokens"] >= meta["prompt_tokens"] - 2 * BS > 0, meta
        await nothing_runs(mocks, app)


async def test_a_streamed_prediction_is_sglangs_generate_stream(http: aiohttp.ClientSession) -> None:
    """``parameters.stream``: SGLang sends the batch's ``/generate`` stream, unwrapped, its events
    numbered by instance."""
    async with mock_fleet(2) as (front, mocks, app):
        body = {
            "instances": instances(CONTRACT, MANUAL),
            "parameters": {"sampling_params": BRIEF, "stream": True},
        }
        status, events, _ = await predict(http, front.url, body)
        assert status == 200, events
        assert {e["index"] for e in events} == {0, 1}
        assert all(e["meta_info"]["completion_tokens"] <= 3 for e in events)
        await nothing_runs(mocks, app)


async def test_token_id_instances_and_no_instances(http: aiohttp.ClientSession) -> None:
    async with mock_fleet(2) as (front, mocks, app):
        body = {"instances": [{"input_ids": list(range(300, 340))}], "parameters": {"sampling_params": BRIEF}}
        status, doc, _ = await predict(http, front.url, body)
        assert status == 200, doc
        assert [p["meta_info"]["prompt_tokens"] for p in doc["predictions"]] == [40]
        # No instances: SGLang answers an empty list (not under "predictions"), engines untouched.
        steps = [m.engine.metrics.steps._value.get() for m in mocks]
        status, doc, _ = await predict(http, front.url, {"instances": []})
        assert (status, doc) == (200, [])
        assert [m.engine.metrics.steps._value.get() for m in mocks] == steps
        await nothing_runs(mocks, app)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "instances"),
        ({"instances": {"text": "hi"}}, "instances"),
        ({"instances": ["hi"]}, "instances[0]"),
        ({"instances": [{"prompt": "hi"}]}, "instances[0].text"),
        ({"instances": [{"text": "hi"}, {"input_ids": [1, 2]}]}, "instances[1].text"),
        ({"instances": [{"text": "hi"}, {"text": 7}]}, "instances[1].text"),
        ({"instances": [{"input_ids": [1, "2"]}]}, "instances[0].input_ids"),
        ({"instances": [{"input_embeds": [[0.5]]}]}, "instances[0].input_embeds"),
        ({"instances": [{"text": "a", "image_data": "i.png"}, {"text": "b"}]}, "instances[1].image_data"),
        ({"instances": [{"text": "hi"}], "parameters": [1]}, "parameters"),
        ({"instances": [{"text": "hi"}], "parameters": {"text": "x"}}, "parameters.text"),
        ({"instances": instances("a", "b"), "parameters": {"sampling_params": [BRIEF]}}, "parameters.sampling_params"),
        # the router's own reading of an instance's request, named where the client put it
        ({"instances": instances("a", "b"), "parameters": {"sampling_params": [BRIEF, 5]}},
         "parameters.sampling_params[1]"),
        # the engine's refusal of the second instance, after the first is running: it is stopped
        ({"instances": instances(CONTRACT, MANUAL),
          "parameters": {"sampling_params": [{"max_new_tokens": 2000}, {"max_new_tokens": -1}]}},
         "parameters.sampling_params[1].max_new_tokens"),
        ({"instances": instances("a", "b"), "nvext": {"session_control": {"session_id": "s", "action": "open"}}},
         "nvext.session_control"),
    ],
)  # fmt: skip
async def test_a_body_sglang_refuses_or_would_mix_up_is_a_400_naming_the_field(
    http: aiohttp.ClientSession, body: dict[str, Any], field: str
) -> None:
    async with mock_fleet(2) as (front, mocks, _):
        status, doc, _ = await predict(http, front.url, body)
        assert (status, doc["error"]["param"]) == (400, field), doc
        for mock in mocks:  # (an instance the engine ran is stopped with the batch)
            await wait_idle(mock.engine)
        # The engine answers the same body so too, served directly.
        status, doc, _ = await predict(http, mocks[0].base_url, body)
        assert (status, doc["error"]["param"]) == (400, field), doc


async def test_the_route_is_where_aip_predict_route_says(
    http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Vertex AI tells the container its path in ``AIP_PREDICT_ROUTE``, and SGLang serves the
    route there: so do the router and the mock, and the default path is then the engine's 404."""
    monkeypatch.setenv(ROUTE_VARIABLE, "/v1/endpoints/7:predict")
    async with mock_fleet(2) as (front, mocks, app):
        body = {"instances": instances(CONTRACT), "parameters": {"sampling_params": BRIEF}}
        for url in (front.url, mocks[0].base_url):
            status, doc, _ = await predict(http, url, body, "/v1/endpoints/7:predict")
            assert status == 200, doc
            assert len(doc["predictions"]) == 1
        async with http.post(mocks[0].base_url + "/vertex_generate", json=body) as r:
            assert r.status == 404
        await nothing_runs(mocks, app)


async def test_the_mock_serves_the_route_as_sglang_does(http: aiohttp.ClientSession) -> None:
    """A client of the engine itself gets SGLang's answer: the predictions of a ``/generate``
    batch, its images paired with their prompts."""
    async with run_mock(block_size=BS, speedup=50.0) as mock:
        body = {"instances": instances("one", "two"), "parameters": {"sampling_params": BRIEF}}
        status, doc, _ = await predict(http, mock.base_url, body)
        assert status == 200, doc
        assert [p["meta_info"]["completion_tokens"] for p in doc["predictions"]] == [3, 3]


async def test_inside_the_engines_an_instance_is_served_by_the_peer_that_caches_it(
    http: aiohttp.ClientSession,
) -> None:
    async with start_mesh(2, RouterConfig(), MockConfig(block_size=BS, speedup=50.0)) as nodes:
        entry, holder = (node.url for node in nodes)
        await warm(http, entry, completion(MockConfig().model, CONTRACT), holder)
        body = {"instances": instances(CONTRACT + "Next."), "parameters": {"sampling_params": BRIEF}}
        status, doc, headers = await predict(http, entry, body)
        assert status == 200, doc
        assert headers[WORKER] == holder
        assert doc["predictions"][0]["meta_info"]["cached_tokens"] > 0
