"""A batch of prompts in one request, through a standalone router in front of mock engines.

SGLang's ``/generate`` takes ``text`` (or ``input_ids``) as a list, and ``/v1/completions`` takes a
list of prompts. Each prompt is routed on its own prefix; the answer is the engine's batch shape:
``/generate`` a list (a stream's events numbered by ``index``), completions one completion with
its choices numbered prompt by prompt and the usage summed.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from kvmesh.router.asgi.batches import BatchAnswer
from kvmesh.router.request.batches import MAX_BATCH, PromptBatch
from tests.router.asgi.test_agent_features import BS, mock_fleet, until
from tests.router.asgi.test_responses_api import WORKER, indexed_as_stored
from tests.router.asgi.test_tokens_api import nothing_runs

FIRST = "Summarise the incident report for the on-call rotation and list every follow-up. " * 6
SECOND = "Translate the release notes into French, keeping the product names in English. " * 6


async def _warm(http: aiohttp.ClientSession, url: str, app: Any, prompt: str, worker: str) -> None:
    """Serve ``prompt`` on ``worker`` once, so that its blocks are cached there."""
    body = {"prompt": prompt, "max_tokens": 1, "nvext": {"backend_instance_id": worker}}
    async with http.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
    decision = app.mesh.router.recent_decisions(1)[-1][1]
    await until(lambda: not app.mesh.router.tracking(decision.request_id))
    await indexed_as_stored(http, url, worker)


async def _post(
    http: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any]
) -> tuple[int, Any, str | None]:
    """(status, the answer or the error, or a stream's events and its [DONE] count; the workers)."""
    async with http.post(url + path, json=body) as r:
        workers = r.headers.get(WORKER)
        if r.status != 200 or not body.get("stream"):
            return r.status, await r.json(), workers
        assert r.content_type == "text/event-stream"
        raw = (await r.read()).decode()
    payloads = [e[len("data: ") :] for e in raw.split("\n\n") if e.startswith("data: ")]
    assert payloads[-1] == "[DONE]" and payloads.count("[DONE]") == 1, raw[-400:]
    return 200, [json.loads(p) for p in payloads[:-1]], workers


def _last_by_index(events: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    last: dict[int, dict[str, Any]] = {}
    for event in events:
        last[event["index"]] = event
    return last


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_each_prompt_of_a_generate_batch_goes_where_its_prefix_is_cached(
    http: aiohttp.ClientSession, stream: bool
) -> None:
    async with mock_fleet(3) as (front, mocks, app):
        homes = [mocks[0].base_url, mocks[2].base_url]
        await _warm(http, front.url, app, FIRST, homes[0])
        await _warm(http, front.url, app, SECOND, homes[1])
        body = {
            "text": [FIRST + "Be brief.", SECOND + "Be brief."],
            "rid": "job",
            "sampling_params": [
                {"max_new_tokens": 3, "ignore_eos": True},
                {"max_new_tokens": 5, "ignore_eos": True},
            ],
            "stream": stream,
        }
        status, answer, workers = await _post(http, front.url, "/generate", body)
        assert status == 200, answer
        assert workers == ",".join(homes)
        if stream:
            assert {e["index"] for e in answer} == {0, 1}
            results = [_last_by_index(answer)[i] for i in (0, 1)]
        else:
            results = answer
        assert [r["meta_info"]["id"] for r in results] == ["job_0", "job_1"]  # SGLang's numbering
        assert [r["meta_info"]["completion_tokens"] for r in results] == [3, 5]
        for result in results:  # (each served where its prefix is: most of it read from cache)
            meta = result["meta_info"]
            assert meta["cached_tokens"] >= (meta["prompt_tokens"] - 2 * BS) > 0, meta
        await nothing_runs(mocks, app)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_samples_of_a_batch_are_numbered_prompt_by_prompt(
    http: aiohttp.ClientSession, stream: bool
) -> None:
    async with mock_fleet(2) as (front, mocks, app):
        ids = [list(range(300, 340)), list(range(500, 570))]
        body = {
            "input_ids": ids,
            "sampling_params": {"n": 2, "max_new_tokens": 2, "ignore_eos": True},
            "stream": stream,
        }
        status, answer, _ = await _post(http, front.url, "/generate", body)
        assert status == 200, answer
        if stream:
            last = _last_by_index(answer)
            assert sorted(last) == [0, 1, 2, 3]
            results = [last[i] for i in range(4)]
        else:
            results = answer
        assert [r["meta_info"]["prompt_tokens"] for r in results] == [40, 40, 70, 70]
        await nothing_runs(mocks, app)


async def test_a_completions_batch_is_one_completion_with_its_usage_summed(
    http: aiohttp.ClientSession,
) -> None:
    async with mock_fleet(2) as (front, mocks, app):
        model = mocks[0].config.model
        lengths = [len(app.mesh.tokenizer.encode(p)) for p in (FIRST, SECOND)]
        body = {"model": model, "prompt": [FIRST, SECOND], "n": 2, "max_tokens": 3, "ignore_eos": True}
        status, answer, workers = await _post(http, front.url, "/v1/completions", body)
        assert status == 200, answer
        assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
        assert answer["usage"]["prompt_tokens"] == sum(lengths)
        assert answer["usage"]["completion_tokens"] == 12
        assert answer["usage"]["total_tokens"] == sum(lengths) + 12
        assert workers is not None and len(workers.split(",")) == 2
        # Streamed with the usage asked for: one id, the choices renumbered, one usage chunk last.
        streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
        status, events, _ = await _post(http, front.url, "/v1/completions", streamed)
        assert status == 200, events
        assert len({e["id"] for e in events}) == 1
        assert {c["index"] for e in events for c in e["choices"]} == {0, 1, 2, 3}
        usage = [e for e in events if not e["choices"]]
        assert len(usage) == 1 and usage[0] is events[-1]
        assert usage[0]["usage"]["prompt_tokens"] == sum(lengths)
        assert usage[0]["usage"]["completion_tokens"] == 12
        # Token-id prompts too.
        tokens = {"model": model, "prompt": [[5, 6, 7], [8, 9]], "max_tokens": 1}
        status, answer, _ = await _post(http, front.url, "/v1/completions", tokens)
        assert status == 200 and answer["usage"]["prompt_tokens"] == 5, answer
        await nothing_runs(mocks, app)


async def test_a_prompt_refused_fails_the_batch_naming_its_field_and_stops_the_others(
    http: aiohttp.ClientSession,
) -> None:
    async with mock_fleet(2) as (front, mocks, app):
        model = mocks[0].config.model
        long = {"max_new_tokens": 2000, "ignore_eos": True}
        for path, bad, field in (
            ("/generate", {"text": [FIRST, ""]}, "text[1]"),
            ("/generate", {"text": [FIRST, 7]}, "text[1]"),
            ("/generate", {"input_ids": [[1, 2], [[3]]]}, "input_ids[1]"),
            ("/generate", {"text": [FIRST, SECOND], "sampling_params": [long]}, "sampling_params"),
            ("/generate", {"text": [FIRST, SECOND], "rid": ["a"]}, "rid"),
            ("/generate", {"text": []}, "text"),
            ("/generate", {"text": ["w"] * (MAX_BATCH + 1)}, "text"),
            ("/generate", {"text": [FIRST, SECOND], "sampling_params": [long, {"n": 2}]}, "sampling_params"),
            # the engine refuses the second prompt after the first is running: it is stopped
            ("/generate", {"text": [FIRST, SECOND], "sampling_params": [long, {"max_new_tokens": -1}]},
             "sampling_params[1].max_new_tokens"),
            ("/generate", {"text": [FIRST, SECOND], "nvext": {"session_control": {"session_id": "s", "action": "open"}}},
             "nvext.session_control"),
            ("/v1/completions", {"model": model, "prompt": [FIRST, {"x": 1}]}, "prompt[1]"),
            ("/v1/completions", {"model": model, "prompt": [FIRST, SECOND], "max_tokens": -2}, "max_tokens"),
            ("/v1/completions", {"model": model, "prompt": [FIRST, SECOND], "nvext": {"extra_fields": ["worker_id"]}},
             "nvext.extra_fields"),
        ):  # fmt: skip
            status, error, _ = await _post(http, front.url, path, bad)
            assert status == 400, (bad, error)
            assert error["error"]["param"] == field, error
        await nothing_runs(mocks, app)


async def test_a_client_that_leaves_a_streamed_batch_stops_every_prompt(http: aiohttp.ClientSession) -> None:
    async with mock_fleet(2) as (front, mocks, app):
        body = {
            "text": [FIRST, SECOND],
            "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True},
            "stream": True,
        }
        async with http.post(front.url + "/generate", json=body) as r:
            assert r.status == 200
            seen = set()
            async for line in r.content:
                if line.startswith(b"data: {"):
                    seen.add(json.loads(line[len(b"data: ") :])["index"])
                if seen == {0, 1}:
                    break
        # (the connection is closed here, both prompts still generating)
        await nothing_runs(mocks, app)
        assert all(m.engine.scheduler.num_running == 0 for m in mocks)


async def test_an_abort_by_a_prompts_numbered_rid_stops_that_prompt(http: aiohttp.ClientSession) -> None:
    """A batch's ``rid`` is numbered per prompt as SGLang numbers it, so an abort by ``rid_1``
    stops prompt 1 wherever it runs (SGLang ignores an abort by the batch's own ``rid``: no request
    has it)."""
    async with mock_fleet(2) as (front, mocks, app):
        body = {
            "text": [FIRST, SECOND],
            "rid": "rollout",
            "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True},
        }
        running = asyncio.create_task(_post(http, front.url, "/generate", body))
        await until(lambda: sum(m.engine.scheduler.num_running for m in mocks) == 2)
        async with http.post(front.url + "/abort_request", json={"rid": "rollout_1"}) as r:
            assert r.status == 200, await r.text()
        status, answer, _ = await asyncio.wait_for(running, 20)
        assert status == 200, answer
        assert [a["meta_info"]["id"] for a in answer] == ["rollout_0", "rollout_1"]
        reasons = [a["meta_info"]["finish_reason"]["type"] for a in answer]
        assert reasons == ["length", "abort"]
        await nothing_runs(mocks, app)


async def test_an_error_in_sglangs_own_flat_shape_is_named_in_the_batch_too() -> None:
    """SGLang's OpenAI routes answer an error as ``{"object": "error", "message", "param"}``, not
    inside ``error``: the batch's answer names its place all the same, and the prompt still
    running sees its client leave."""
    batch = PromptBatch(
        [{"text": "a", "sampling_params": {}}, {"text": "b", "sampling_params": {"max_new_tokens": -1}}],
        1,
        frozenset(("text", "sampling_params")),
    )
    left = asyncio.Event()

    async def run_one(scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = json.loads((await receive())["body"])
        if body["text"] == "a":  # (a prompt still being served: it ends once its client leaves)
            assert (await receive())["type"] == "http.disconnect"
            left.set()
            return
        error = {
            "object": "error",
            "message": "bad",
            "type": "BadRequestError",
            "param": "sampling_params.max_new_tokens",
        }
        await send(
            {
                "type": "http.response.start",
                "status": 400,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": json.dumps(error).encode()})

    sent: list[dict[str, Any]] = []

    async def client_receive() -> dict[str, Any]:
        await asyncio.Event().wait()  # (the client stays)
        return {"type": "http.disconnect"}

    async def client_send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/generate", "headers": []}
    await BatchAnswer(run_one, scope, client_receive, client_send, batch, "/generate", False).run()
    assert left.is_set()
    assert sent[0]["status"] == 400
    doc = json.loads(sent[1]["body"])
    assert doc["param"] == "sampling_params[1].max_new_tokens"
    assert doc["message"] == "prompt 1 of the batch: bad"


async def _warm_chat(http: aiohttp.ClientSession, url: str, app: Any, messages: Any, worker: str) -> None:
    """Serve a chat of ``messages`` on ``worker`` once, so that its blocks are cached there."""
    body = {"messages": messages, "max_tokens": 1, "nvext": {"backend_instance_id": worker}}
    async with http.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
    decision = app.mesh.router.recent_decisions(1)[-1][1]
    await until(lambda: not app.mesh.router.tracking(decision.request_id))
    await indexed_as_stored(http, url, worker)


async def test_each_conversation_of_a_chat_batch_goes_where_its_prefix_is_cached(
    http: aiohttp.ClientSession,
) -> None:
    """vLLM's ``/v1/chat/completions/batch``: ``messages`` is a list of conversations; the answer
    is one chat completion, a choice per conversation numbered in order, the usage summed."""
    async with mock_fleet(3) as (front, mocks, app):
        model = mocks[0].config.model
        homes = [mocks[2].base_url, mocks[0].base_url]
        conversations = [
            [{"role": "system", "content": FIRST}, {"role": "user", "content": "Be brief."}],
            [{"role": "system", "content": SECOND}, {"role": "user", "content": "Be brief."}],
        ]
        for conversation, home in zip(conversations, homes, strict=True):
            await _warm_chat(http, front.url, app, conversation[:1], home)
        body = {"model": model, "messages": conversations, "max_tokens": 3, "ignore_eos": True}
        status, answer, workers = await _post(http, front.url, "/v1/chat/completions/batch", body)
        assert status == 200, answer
        assert workers == ",".join(homes)
        assert answer["object"] == "chat.completion"
        assert [c["index"] for c in answer["choices"]] == [0, 1]
        assert all(c["message"]["role"] == "assistant" for c in answer["choices"])
        usage = answer["usage"]
        assert usage["completion_tokens"] == 6
        assert usage["total_tokens"] == usage["prompt_tokens"] + 6
        cached = usage["prompt_tokens_details"]["cached_tokens"]  # (each read mostly from cache)
        assert cached >= usage["prompt_tokens"] - 4 * BS > 0, usage
        # one conversation is a batch too: the answer keeps the batch's shape
        one = {**body, "messages": conversations[:1], "n": 2}
        status, answer, _ = await _post(http, front.url, "/v1/chat/completions/batch", one)
        assert status == 200 and [c["index"] for c in answer["choices"]] == [0, 1], answer
        await nothing_runs(mocks, app)


async def test_a_chat_batch_the_router_cannot_serve_is_a_400_naming_the_field(
    http: aiohttp.ClientSession,
) -> None:
    async with mock_fleet(2) as (front, mocks, app):
        model = mocks[0].config.model
        good = [{"role": "user", "content": "hello"}]
        for bad, field in (
            ({"messages": [{"role": "user", "content": "hi"}]}, "messages[0]"),  # (one chat's shape)
            ({"messages": []}, "messages"),
            ({"messages": "hi"}, "messages"),
            ({"messages": [good, []]}, "messages[1]"),
            ({"messages": [good, good], "stream": True}, "stream"),
            ({"messages": [good] * (MAX_BATCH + 1)}, "messages"),
            ({"messages": [good, good], "nvext": {"extra_fields": ["worker_id"]}}, "nvext.extra_fields"),
            ({"messages": [good, [{"role": "user", "content": 7}]]}, "messages[1]"),  # (the engine's)
            ({"messages": [good, good], "max_tokens": -1}, "max_tokens"),
        ):
            status, error, _ = await _post(
                http, front.url, "/v1/chat/completions/batch", {"model": model, **bad}
            )
            assert status == 400, (bad, error)
            assert error["error"]["param"] == field or error["error"]["param"].startswith(field), (bad, error)
            if field == "messages[1]" and "content" in error["error"]["param"]:  # (the engine's, named)
                assert error["error"]["message"].startswith("conversation 1 of the batch: "), error
        await nothing_runs(mocks, app)
