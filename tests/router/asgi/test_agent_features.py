"""Agent features over HTTP, standalone router in front of mock engines: each one takes effect.

cache_control pins the prompt *and the answer* after the response (behind --enable-cache-control);
a session holds its turns' blocks on the engine from its first turn; a speculative prefill warms the
next turn; a non-streaming request's prefill load goes before its answer does; nvext fields reach
the engine in its own form or are refused.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from kvmesh.mock.testing import RunningMock, run_mock
from kvmesh.router.asgi.standalone import build_router_app
from kvmesh.router.core.config import RouterConfig
from kvmesh.router.mesh.metrics import get_metrics
from kvmesh.router.mesh.settings import MeshSettings, WorkerSpec
from kvmesh.router.request.tokenizer import BuiltinTokenizer
from tests.router.fleet import chat, fleet
from tests.router.servers import Server, serve

BS = 16


@contextlib.asynccontextmanager
async def mock_fleet(
    n: int = 1, router: RouterConfig | None = None, **mock: Any
) -> AsyncIterator[tuple[Server, list[RunningMock], Any]]:
    """``n`` mock engines (KV events on) behind one standalone router; yields (front, mocks, app)."""
    async with contextlib.AsyncExitStack() as stack:
        mocks = [
            await stack.enter_async_context(run_mock(block_size=BS, speedup=50.0, **mock)) for _ in range(n)
        ]
        settings = MeshSettings(
            workers=tuple(WorkerSpec(m.base_url, m.base_url) for m in mocks),
            router=router or RouterConfig(),
            health_interval=0.2,
        )
        app = build_router_app(settings)
        front = await stack.enter_async_context(serve(app))
        yield front, mocks, app


async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with http.post(url + "/v1/chat/completions", json=body) as r:
        return r.status, await r.json()


async def until(check: Any, tries: int = 250) -> None:
    for _ in range(tries):
        if check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition never held")


def turn(mock: RunningMock, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": mock.config.model, "messages": messages, "max_tokens": 20, "ignore_eos": True, **extra}


# ---------------------------------------------------------------------------------- cache_control
async def test_cache_control_is_refused_while_the_gate_is_off(http: aiohttp.ClientSession) -> None:
    async with mock_fleet() as (front, mocks, _):
        body = turn(mocks[0], [{"role": "user", "content": "x"}], nvext={"cache_control": {"ttl": "5m"}})
        status, doc = await post(http, front.url, body)
        assert status == 400
        assert doc["error"]["param"] == "nvext.cache_control"
        assert "--enable-cache-control" in doc["error"]["message"]


async def test_a_pin_after_the_response_holds_prompt_and_answer(http: aiohttp.ClientSession) -> None:
    async with mock_fleet(router=RouterConfig(enable_cache_control=True)) as (front, mocks, _):
        mock = mocks[0]
        messages = [{"role": "user", "content": "a fresh prompt nobody sent before " * 6}]
        prompt = BuiltinTokenizer().apply_chat_template(messages)
        body = turn(
            mock, messages, max_tokens=48, nvext={"cache_control": {"type": "ephemeral", "ttl": "5m"}}
        )
        status, doc = await post(http, front.url, body)
        assert status == 200, doc
        # every full block of prompt + answer (but its last token, never fed back), though none
        # was cached when the request arrived
        want = (len(prompt) + 48 - 1) // BS
        assert want > len(prompt) // BS
        await until(lambda: mock.engine.retention.num_retained >= want)
        assert mock.engine.retention.num_retained == want


async def test_a_pinned_repeat_of_a_prompt_pins_its_own_prompt_and_answer(
    http: aiohttp.ClientSession,
) -> None:
    # the same messages again are sent without being tokenized (the first one's blocks are theirs):
    # their tokens are worked out when the pin after the answer needs them
    async with mock_fleet(router=RouterConfig(enable_cache_control=True)) as (front, mocks, app):
        mock = mocks[0]
        messages = [{"role": "user", "content": "the same question, asked twice " * 6}]
        prompt = BuiltinTokenizer().apply_chat_template(messages)
        status, doc = await post(http, front.url, turn(mock, messages, max_tokens=16))
        assert status == 200, doc
        pin = {"cache_control": {"type": "ephemeral", "ttl": "5m"}}
        status, doc = await post(http, front.url, turn(mock, messages, max_tokens=64, nvext=pin))
        assert status == 200, doc
        assert app.mesh.turn_memo.same == 1  # the second was sent as the first one's twin
        want = (len(prompt) + 64 - 1) // BS
        await until(lambda: mock.engine.retention.num_retained >= want)
        assert mock.engine.retention.num_retained == want


async def test_a_pin_the_worker_refuses_shows_in_workers_and_metrics(http: aiohttp.ClientSession) -> None:
    config = RouterConfig(enable_cache_control=True)
    async with mock_fleet(router=config, num_blocks=64, pin_budget=0.01) as (front, mocks, _):
        body = turn(
            mocks[0], [{"role": "user", "content": "too long to pin " * 20}], nvext={"cache_control": {}}
        )
        assert (await post(http, front.url, body))[0] == 200

        async def pins() -> Any:
            async with http.get(front.url + "/kvmesh/workers") as r:
                return (await r.json())["workers"][0]["cache_control_pins"]

        for _ in range(250):
            row = await pins()
            if row is not None and row["pinned"] + row["partial"] + row["failed"]:
                break
            await asyncio.sleep(0.02)
        assert row["failed"] == 1 and row["pinned"] == 0, row
        assert "409" in row["last_error"]
        async with http.get(front.url + "/metrics") as r:
            text = await r.text()
        assert f'kvmesh_cache_control_pins_total{{outcome="failed",worker="{mocks[0].base_url}"}}' in text


async def test_a_pinned_turn_survives_eviction_pressure_that_evicts_an_unpinned_one(
    http: aiohttp.ClientSession,
) -> None:
    tok = BuiltinTokenizer()
    config = RouterConfig(enable_cache_control=True)
    async with mock_fleet(router=config, num_blocks=64) as (front, mocks, _):  # 1024 tokens of cache
        mock = mocks[0]
        pinned = [{"role": "user", "content": "the pinned conversation starts here " * 5}]
        unpinned = [{"role": "user", "content": "an unpinned conversation opens too " * 5}]
        pin = {"cache_control": {"type": "ephemeral", "ttl": "5m"}}
        # the pinned turn goes first: plain LRU would evict it before the unpinned one
        status, a = await post(http, front.url, turn(mock, pinned, max_tokens=48, nvext=pin))
        assert status == 200, a
        status, b = await post(http, front.url, turn(mock, unpinned, max_tokens=48))
        assert status == 200, b
        want = (len(tok.apply_chat_template(pinned)) + 48 - 1) // BS  # prompt + answer blocks
        await until(lambda: mock.engine.retention.num_retained >= want)
        for i in range(12):  # ~12 blocks each: the whole cache over twice
            flood = [{"role": "user", "content": f"unrelated flood prompt number {i} " * 6}]
            assert (await post(http, front.url, turn(mock, flood, max_tokens=32)))[0] == 200

        async def cached_on_return(messages: list[dict[str, Any]], answer: dict[str, Any]) -> int:
            follow = [*messages, answer["choices"][0]["message"], {"role": "user", "content": "go on"}]
            status, doc = await post(http, front.url, turn(mock, follow, max_tokens=1))
            assert status == 200, doc
            return int(doc["usage"]["prompt_tokens_details"]["cached_tokens"])

        assert await cached_on_return(unpinned, b) == 0  # the pressure was real
        # the pinned turn's prompt and its answer are still there
        assert await cached_on_return(pinned, a) >= want * BS > len(tok.apply_chat_template(pinned))


# ---------------------------------------------------------------------------------- sessions
async def test_a_session_holds_its_turns_on_the_engine_until_closed(http: aiohttp.ClientSession) -> None:
    async with mock_fleet() as (front, mocks, _):
        mock = mocks[0]
        retention = mock.engine.retention
        messages = [{"role": "user", "content": "first turn of a long conversation " * 6}]
        control = {"session_id": "conv-1", "action": "open", "timeout": 60}
        status, doc = await post(http, front.url, turn(mock, messages, nvext={"session_control": control}))
        assert status == 200, doc
        assert "conv-1" in retention.sessions  # opened before the turn was sent
        first = retention.num_retained
        assert first >= len(BuiltinTokenizer().apply_chat_template(messages)) // BS  # the turn is held
        messages += [doc["choices"][0]["message"], {"role": "user", "content": "and a second turn " * 4}]
        control = {"session_id": "conv-1", "action": "close"}
        status, doc = await post(http, front.url, turn(mock, messages, nvext={"session_control": control}))
        assert status == 200, doc
        assert doc["usage"]["prompt_tokens_details"]["cached_tokens"] >= first * BS
        await until(lambda: "conv-1" not in retention.sessions)  # closed after the turn
        assert retention.num_retained == 0


async def test_a_session_the_worker_cannot_open_is_an_error_naming_the_field(
    http: aiohttp.ClientSession,
) -> None:
    # the router's own ceiling raised, so the worker's (7 days) is the one that refuses
    async with mock_fleet(router=RouterConfig(router_session_timeout_max_secs=10**8)) as (front, mocks, _):
        control = {"session_id": "s", "action": "open", "timeout": 30 * 24 * 3600}  # past the worker's cap
        body = turn(mocks[0], [{"role": "user", "content": "x"}], nvext={"session_control": control})
        status, doc = await post(http, front.url, body)
        assert status == 502
        assert doc["error"]["param"] == "nvext.session_control"
        async with http.get(front.url + "/kvmesh/workers") as r:  # no load left behind
            assert (await r.json())["workers"][0]["active_requests"] == 0


async def test_an_idle_session_closes_the_engine_session(http: aiohttp.ClientSession) -> None:
    async with mock_fleet() as (front, mocks, _):
        retention = mocks[0].engine.retention
        control = {"session_id": "brief", "action": "open", "timeout": 0.3}
        body = turn(
            mocks[0], [{"role": "user", "content": "hello " * 40}], nvext={"session_control": control}
        )
        assert (await post(http, front.url, body))[0] == 200
        assert "brief" in retention.sessions
        await until(lambda: "brief" not in retention.sessions)


@contextlib.asynccontextmanager
async def synced_replicas(
    http: aiohttp.ClientSession, engines: int, config: RouterConfig
) -> AsyncIterator[tuple[list[RunningMock], list[Server], tuple[Any, Any]]]:
    """``engines`` mock engines behind two standalone routers (``config``, replica sync on) that
    follow each other; yields (mocks, fronts, the two replicas' meshes)."""
    async with contextlib.AsyncExitStack() as stack:
        mocks = [
            await stack.enter_async_context(run_mock(block_size=BS, speedup=50.0)) for _ in range(engines)
        ]
        settings = MeshSettings(
            workers=tuple(WorkerSpec(m.base_url, m.base_url) for m in mocks),
            router=config,
            health_interval=0.2,
        )
        apps = [build_router_app(settings) for _ in range(2)]
        fronts = [await stack.enter_async_context(serve(app)) for app in apps]
        for front in fronts:
            async with http.get(front.url + "/health") as r:
                assert r.status == 200
        a, b = (app.mesh for app in apps)
        assert a.sync is not None and b.sync is not None
        a.sync.follow(b.sync.endpoint or "")
        b.sync.follow(a.sync.endpoint or "")
        await asyncio.sleep(0.3)  # (the SUB sockets connect)
        yield mocks, fronts, (a, b)


async def test_a_bind_made_through_one_replica_is_honoured_by_another(http: aiohttp.ClientSession) -> None:
    config = RouterConfig(router_replica_sync=True, router_temperature=0.0)
    async with synced_replicas(http, 2, config) as (mocks, fronts, (a, b)):
        control = {"session_id": "shared", "action": "bind"}
        body = turn(
            mocks[0], [{"role": "user", "content": "bound here " * 30}], nvext={"session_control": control}
        )
        status, _ = await post(http, fronts[0].url, body)
        assert status == 200
        bound = a.router.session_worker("shared")
        assert bound is not None
        await until(lambda: b.router.session_worker("shared") == bound)
        # replica b sends the session's next turn, of a wholly different prompt, to the same worker
        body = turn(
            mocks[0],
            [{"role": "user", "content": "nothing alike " * 30}],
            nvext={"session_control": {"session_id": "shared"}, "extra_fields": ["worker_id"]},
        )
        status, doc = await post(http, fronts[1].url, body)
        assert status == 200
        assert doc["nvext"]["worker_id"]["decode_worker_id"] == bound[0]


# ---------------------------------------------------------------------------------- speculative prefill
async def test_speculative_prefill_warms_the_next_turn_through_the_answer(
    http: aiohttp.ClientSession,
) -> None:
    tok = BuiltinTokenizer()
    async with mock_fleet() as (front, mocks, app):
        mock = mocks[0]
        # a prompt whose turn (prompt + answer + end-of-turn marks) fills its last block exactly:
        # only a warm-up computes that block, the first turn alone never does
        for pad in range(BS):
            messages = [{"role": "user", "content": "speculate about this " * 8 + "x " * pad}]
            if (len(tok.apply_chat_template(messages)) + 20) % BS == BS - 2:
                break
        hints = {"agent_hints": {"speculative_prefill": True}}
        status, doc = await post(http, front.url, turn(mock, messages, nvext=hints))
        assert status == 200, doc
        answer = doc["choices"][0]["message"]["content"]
        history = [*messages, {"role": "assistant", "content": answer}]
        through_answer = len(tok.apply_chat_template(history, add_generation_prompt=False))
        assert through_answer % BS == 0, "the answer's ids round-trip through the builtin tokenizer"
        await until(lambda: not app.mesh._warmups)
        await asyncio.sleep(0.1)
        status, doc = await post(http, front.url, turn(mock, [*history, {"role": "user", "content": "next"}]))
        assert status == 200
        assert doc["usage"]["prompt_tokens_details"]["cached_tokens"] >= through_answer


# ---------------------------------------------------------------------------------- load without streaming
async def test_a_non_streaming_request_releases_its_prefill_before_its_answer(
    http: aiohttp.ClientSession,
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        mock = await stack.enter_async_context(run_mock(block_size=BS, speedup=2.0))
        settings = MeshSettings(workers=(WorkerSpec(mock.base_url, mock.base_url),), health_interval=0.2)
        front = await stack.enter_async_context(serve(build_router_app(settings)))
        body = turn(mock, [{"role": "user", "content": "long answer please " * 30}], max_tokens=400)
        request = asyncio.ensure_future(post(http, front.url, body))

        async def row() -> dict[str, Any]:
            async with http.get(front.url + "/kvmesh/workers") as r:
                return (await r.json())["workers"][0]["ranks"][0]  # type: ignore[no-any-return]

        released_early = False  # a fresh prompt: prefill tokens count until released
        while not request.done():
            r = await row()
            released_early |= r["active_requests"] == 1 and r["active_prefill_tokens"] == 0
            await asyncio.sleep(0.01)
        status, doc = request.result()
        assert status == 200 and doc["usage"]["completion_tokens"] == 400
        assert released_early


async def test_the_engines_own_load_shows_beside_the_routers_estimate(http: aiohttp.ClientSession) -> None:
    config = RouterConfig(router_queue_threshold=None)  # both requests reach the engine at once
    async with mock_fleet(router=config, max_num_seqs=1) as (front, mocks, _):
        mock = mocks[0]  # one sequence at a time: the second request waits inside the engine

        async def row() -> dict[str, Any]:
            async with http.get(front.url + "/kvmesh/workers") as r:
                return (await r.json())["workers"][0]  # type: ignore[no-any-return]

        body = turn(mock, [{"role": "user", "content": "keep the engine busy " * 20}], max_tokens=4000)
        requests = [asyncio.ensure_future(post(http, front.url, body)) for _ in range(2)]
        seen = None
        while not all(r.done() for r in requests):
            got = await row()
            if got["engine_load"] is not None and got["engine_load"]["waiting"] == 1:
                seen = got
                break
            await asyncio.sleep(0.02)
        assert seen is not None, "the engine never reported a waiting request"
        assert seen["engine_load"]["running"] == 1 and seen["active_requests"] == 2  # the router's view
        async with http.get(front.url + "/metrics") as r:
            text = await r.text()
        for state in ("running", "waiting"):
            assert f'state="{state}",worker="{mock.base_url}"}}' in text
        for request in requests:
            assert (await request)[0] == 200
        for _ in range(250):  # the next health check reads an idle engine
            load = (await row())["engine_load"]
            if load == {**load, "running": 0.0, "waiting": 0.0}:
                break
            await asyncio.sleep(0.02)
        assert (load["running"], load["waiting"]) == (0.0, 0.0)


async def test_a_stream_without_usage_counts_its_output_in_tokens(http: aiohttp.ClientSession) -> None:
    """Each chunk carries many tokens and no usage ever arrives: the router tokenizes the deltas."""
    text = "several tokens ride in this one chunk, " * 4
    per_chunk = len(BuiltinTokenizer().encode(text))
    assert per_chunk >= 2 * BS
    osl = get_metrics().osl
    router = RouterConfig(use_kv_events=False, router_track_output_blocks=True, router_queue_threshold=None)
    engine = {"text": text, "chunks": 4, "gap": 0.3, "stream_usage": False}
    async with fleet(1, router=router, engine_kwargs=engine) as (front, states, _):

        async def decode_blocks() -> float:
            async with http.get(front.url + "/kvmesh/workers") as r:
                return (await r.json())["workers"][0]["ranks"][0]["active_decode_blocks"]  # type: ignore[no-any-return]

        prompt_blocks = len(BuiltinTokenizer().apply_chat_template(chat("x")["messages"])) // BS
        before = osl._sum.get()
        request = asyncio.ensure_future(post_stream(http, front.url, chat("x", stream=True)))
        grown = False  # mid-stream, the answer's blocks count: a chunk is many tokens, not one
        while not request.done():
            grown |= await decode_blocks() >= prompt_blocks + 2 * per_chunk // BS
            await asyncio.sleep(0.02)
        assert (await request) == 200 and grown
        assert osl._sum.get() - before == 4 * per_chunk
        # with a usage event at the end, the engine's count (4 here) replaces the estimate
        states[0].stream_usage = True
        before = osl._sum.get()
        assert await post_stream(http, front.url, chat("x", stream=True)) == 200
        assert osl._sum.get() - before == 4


async def post_stream(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> int:
    async with http.post(url + "/v1/chat/completions", json=body) as r:
        await r.read()
        return r.status


# ---------------------------------------------------------------------------------- nvext -> engine
async def test_nvext_fields_reach_the_engine_in_its_own_form(http: aiohttp.ClientSession) -> None:
    async with fleet(1) as (front, states, _):
        received = states[0].received
        body = chat("x", temperature=0.9, top_p=0.5, nvext={"greed_sampling": True, "ignore_eos": True})
        assert (await post(http, front.url, body))[0] == 200
        assert received[-1]["temperature"] == 0.0 and received[-1]["top_k"] == 1
        assert "top_p" not in received[-1] and received[-1]["ignore_eos"] is True
        ids = [256 + i for i in range(40)]
        completion = {"model": "test-model", "prompt": "ignored", "nvext": {"token_data": ids}}
        async with http.post(front.url + "/v1/completions", json=completion) as r:
            assert r.status == 200
        assert received[-1]["prompt"] == ids
        refused = [
            (chat("x", nvext={"max_thinking_tokens": 64}), "nvext.max_thinking_tokens"),  # no budget param
            (chat("x", nvext={"token_data": ids}), "nvext.token_data"),  # chat has no token prompt
            (chat("x", nvext={"use_raw_prompt": True}), "nvext.use_raw_prompt"),
            (chat("x", nvext={"annotations": ["token_ids"]}), "nvext.annotations"),  # needs stream
            (chat("x", nvext={"sampling_magic": 1}), "nvext.sampling_magic"),
            (chat("x", nvext={"agent_hints": {"osl2": 1}}), "nvext.agent_hints.osl2"),
        ]
        before = len(received)
        for body, field in refused:
            status, doc = await post(http, front.url, body)
            assert (status, doc["error"]["param"]) == (400, field), doc
        assert len(received) == before


async def test_max_thinking_tokens_reaches_vllm_style_engines(http: aiohttp.ClientSession) -> None:
    async with mock_fleet() as (front, mocks, _):
        body = turn(mocks[0], [{"role": "user", "content": "x"}], nvext={"max_thinking_tokens": -1})
        assert (await post(http, front.url, body))[1]["error"]["param"] == "nvext.max_thinking_tokens"
        body = turn(mocks[0], [{"role": "user", "content": "x"}], nvext={"max_thinking_tokens": 64})
        assert (await post(http, front.url, body))[0] == 200  # the mock validates thinking_token_budget


async def test_token_annotations_lead_the_stream(http: aiohttp.ClientSession) -> None:
    async with mock_fleet() as (front, mocks, _):
        messages = [{"role": "user", "content": "annotate me"}]
        body = turn(mocks[0], messages, stream=True, nvext={"annotations": ["token_ids", "formatted_prompt"]})
        async with http.post(front.url + "/v1/chat/completions", json=body) as r:
            text = await r.text()
        tok = BuiltinTokenizer()
        ids = tok.apply_chat_template(messages)
        head = text.split("\n\n")
        assert head[0] == "event: token_ids\n: " + str(ids).replace(" ", "")
        assert head[1].startswith("event: formatted_prompt\n: ")
        assert head[2].startswith("data: ")


async def test_the_older_overlap_weight_is_honoured_per_request(http: aiohttp.ClientSession) -> None:
    # weight 0: no overlap credit and no prefill weight, so a cached prefix no longer attracts
    # (the reference's formula, where the field comes from: equal costs are then a tie)
    router = RouterConfig(use_kv_events=False, router_queue_threshold=None, router_cost_model="dynamo")
    async with fleet(2, router=router) as (
        front,
        _states,
        _,
    ):
        prompt = "shared prefix that is long enough to span blocks " * 10
        first = chat(prompt, nvext={"extra_fields": ["worker_id"]})
        status, doc = await post(http, front.url, first)
        home = doc["nvext"]["worker_id"]["decode_worker_id"]
        sticky = await post(http, front.url, first)
        assert status == 200 and sticky[1]["nvext"]["worker_id"]["decode_worker_id"] == home
        body = chat(
            prompt, nvext={"extra_fields": ["worker_id"], "agent_hints": {"kv_overlap_score_weight": 0}}
        )
        status, doc = await post(http, front.url, body)
        # equal costs, ties go to the smaller index: the prefix cached at home earns nothing
        assert status == 200 and doc["nvext"]["worker_id"]["decode_worker_id"] != home


# ---------------------------------------------------------------------------------- osl
async def test_an_osl_makes_a_worker_with_long_answers_look_busy(http: aiohttp.ClientSession) -> None:
    async def second_lands_on(osl: int | None) -> bool:
        # Dynamo's cost adds the expected answer's blocks to the decode load directly; the latency
        # cost feels them only as memory pressure, once it has learned how long decodes take.
        config = RouterConfig(use_kv_events=False, router_queue_threshold=None, router_cost_model="dynamo")
        async with fleet(2, router=config, engine_kwargs={"hold": 2.0}) as (front, states, _):
            prefix = "a shared system prompt for both requests " * 12
            hints = {"agent_hints": {"osl": osl}} if osl else {}
            first = asyncio.ensure_future(post(http, front.url, chat(prefix + "one", nvext=hints)))
            await until(lambda: sum(len(s.received) for s in states) == 1)
            home = 0 if states[0].received else 1
            for _ in range(250):  # its prefill is over (estimated): only its decode load remains
                async with http.get(front.url + "/kvmesh/workers") as r:
                    rows = (await r.json())["workers"]
                if all(w["ranks"][0]["active_prefill_tokens"] == 0 for w in rows):
                    break
                await asyncio.sleep(0.02)
            second = chat(prefix + "two", nvext={"extra_fields": ["worker_id"]})
            status, _ = await post(http, front.url, second)
            await first
            assert status == 200
            return len(states[home].received) == 2

    assert await second_lands_on(None)  # the shared prefix wins
    assert not await second_lands_on(4096)  # 256 blocks of expected answer outweigh it


# ---------------------------------------------------------------------------------- /busy_threshold
async def test_busy_threshold_takes_the_reference_body(http: aiohttp.ClientSession) -> None:
    async with mock_fleet() as (front, mocks, _):
        model = mocks[0].config.model
        doc = {
            "model": model,
            "active_decode_blocks_threshold": 0.85,
            "active_prefill_tokens_threshold": 1000,
        }
        async with http.post(front.url + "/busy_threshold", json=doc) as r:
            assert r.status == 200
            assert await r.json() == {**doc, "active_prefill_tokens_threshold_frac": None}
        async with http.post(front.url + "/busy_threshold", json={"model": model}) as r:
            assert (await r.json())["active_decode_blocks_threshold"] == 0.85
        async with http.get(front.url + "/busy_threshold") as r:
            assert (await r.json())["thresholds"][0]["model"] == model
        async with http.post(
            front.url + "/busy_threshold", json={"model": "other", "active_prefill_tokens_threshold": 5}
        ) as r:
            assert r.status == 404
