"""A stock trtllm-serve (no kvmesh launcher) behind kvmesh's router: ``kvmesh events trtllm URL``
reads its ``POST /kv_cache_events`` and publishes kvmesh's ZMQ wire; the router follows the entry
the command prints.

The engines are the fake trtllm-serve (``fake/tensorrt_llm``: TensorRT-LLM's ``OpenAIServer`` routes
and its destructive, bounded event queue) on loopback; the command runs as a user runs it, in a
subprocess, and the router is kvmesh's standalone app loaded from a TOML file.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType
from typing import Any

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route

from kvmesh.adapters.trtllm.convert import EventConverter
from kvmesh.adapters.trtllm.served_queue import block_size_seen
from kvmesh.commands.events_trtllm import check_events
from kvmesh.errors import ConfigError
from kvmesh.router.asgi.standalone import build_router_app
from kvmesh.router.mesh.settings import MeshSettings, WorkerSpec
from tests.fuzz.strategies import ANY_JSON
from tests.router.servers import bound_socket, serve

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[3]
BS = 4
PROMPT = list(range(100, 141))
"""41 token ids: the engine stores 40 of them (never a prompt's last), ten full blocks."""


def _fake_engine(trtllm: ModuleType, *, tokens_per_block: int = BS, **llm: Any) -> tuple[Any, Any]:
    """(the LLM, trtllm-serve's app) of one stock fake engine with KV events on."""
    from tensorrt_llm.llmapi.llm import LLM
    from tensorrt_llm.serve import OpenAIServer

    engine = LLM(
        kv_cache_config={"tokens_per_block": tokens_per_block, "event_buffer_max_size": 1024},
        capacity_blocks=64,
        **llm,
    )
    return engine, OpenAIServer(generator=engine, model="fake-model").app


class Bridge:
    """``kvmesh events trtllm`` in a subprocess; its stderr read line by line."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lines: list[str] = []

    async def line(self, timeout: float = 30.0) -> str:
        assert self.proc.stderr is not None
        raw = await asyncio.wait_for(self.proc.stderr.readline(), timeout)
        if not raw:
            raise AssertionError(f"the command ended: {self.lines}")
        self.lines.append(raw.decode().rstrip("\n"))
        return self.lines[-1]

    async def until(self, text: str) -> str:
        while True:
            line = await self.line()
            if text in line:
                return line

    async def entry(self) -> dict[str, Any]:
        """The ``[[workers]]`` entry it printed for the router, parsed as the router parses TOML."""
        await self.until("the router's entry for this engine:")
        lines = [await self.line() for _ in range(6)]  # (through kv_replay_endpoints)
        return tomllib.loads("\n".join(lines))["workers"][0]  # type: ignore[no-any-return]

    async def stop(self) -> dict[str, Any]:
        """SIGTERM; the summary it prints on the way out."""
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.stderr is not None
        rest = (await asyncio.wait_for(self.proc.stderr.read(), 30)).decode()
        assert await self.proc.wait() == 0, [*self.lines, rest]
        last = rest.strip().splitlines()[-1]
        assert last.startswith("kvmesh events trtllm: stopped "), rest
        return json.loads(last.removeprefix("kvmesh events trtllm: stopped "))  # type: ignore[no-any-return]


@contextlib.asynccontextmanager
async def bridge(url: str, *flags: str) -> AsyncIterator[Bridge]:
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvmesh",
        "events",
        "trtllm",
        url,
        "--endpoint",
        "tcp://127.0.0.1:0",
        "--replay-endpoint",
        "tcp://127.0.0.1:0",
        *flags,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    running = Bridge(proc)
    try:
        yield running
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def _rows(http: aiohttp.ClientSession, front: str) -> dict[str, dict[str, Any]]:
    async with http.get(front + "/kvmesh/workers") as r:
        return {w["worker_id"]: w for w in (await r.json())["workers"]}


async def _until(check: Any, what: str, timeout: float = 20.0) -> Any:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = await check()
        if value:
            return value
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{what} did not happen in {timeout} s")
        await asyncio.sleep(0.05)


async def test_a_stock_trtllm_serve_is_routed_on_its_cache_through_the_command(
    fake_trtllm: ModuleType, tmp_path: Path
) -> None:
    """Two stock engines, each with the command beside it (started before its engine listens);
    a router given the entries they print indexes what each engine caches, and sends a prompt back
    to the engine that holds it, which reports the hit."""
    engines = [_fake_engine(fake_trtllm) for _ in range(2)]
    sockets = [bound_socket() for _ in engines]
    urls = [f"http://127.0.0.1:{s.getsockname()[1]}" for s in sockets]
    async with contextlib.AsyncExitStack() as stack, aiohttp.ClientSession() as http:
        bridges = [await stack.enter_async_context(bridge(url, "--block-size", str(BS))) for url in urls]
        entries = [await b.entry() for b in bridges]
        for b in bridges:  # (nothing listens yet: the command says so and keeps polling)
            await b.until("until it answers")
        for (_, app), sock in zip(engines, sockets, strict=True):
            await stack.enter_async_context(serve(app, sock))
        for b in bridges:
            await b.until("answers again")
        assert [e["url"] for e in entries] == urls
        assert {(e["backend"], e["block_size"]) for e in entries} == {("trtllm", BS)}
        config = tmp_path / "kvmesh.toml"
        config.write_text(
            "\n".join(
                "[[workers]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in e.items()) for e in entries
            )
        )
        mesh = MeshSettings.load(environ={"KVMESH_CONFIG": str(config)}, health_interval=0.1)
        front = (await stack.enter_async_context(serve(build_router_app(mesh)))).url

        async def all_up() -> bool:
            return all(row["state"] == "up" for row in (await _rows(http, front)).values())

        await _until(all_up, "both workers up")
        for row in (await _rows(http, front)).values():
            assert (row["backend"], row["described_by"], row["block_size"]) == ("trtllm", "config", BS), row
        body = {"model": "fake-model", "prompt": PROMPT, "max_tokens": 2}
        async with http.post(front + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            first = r.headers["x-kvmesh-worker-id"]

        async def indexed() -> bool:
            return (await _rows(http, front))[first]["indexed_blocks"] >= (len(PROMPT) - 1) // BS

        await _until(indexed, f"{first}'s blocks indexed through the command")
        for _ in range(3):
            async with http.post(front + "/v1/completions", json=body) as r:
                doc = await r.json()
                assert r.headers["x-kvmesh-worker-id"] == first, doc
            assert doc["usage"]["prompt_tokens_details"]["cached_tokens"] == len(PROMPT) - 1, doc
        other = engines[1 - urls.index(first)][0]
        assert other.calls == []  # (nothing of this prompt went to the engine without it)
        summaries = [await b.stop() for b in bridges]
    busy = summaries[urls.index(first)]
    assert busy["events"] >= 2 and busy["bridged"] >= 1 and busy["resyncs"] == 0, busy
    assert busy["capacity_blocks"] == {"0": 64}, busy  # (from the engine's start-up event)


async def test_a_stock_trtllm_serve_with_no_entry_is_down_naming_the_command(
    fake_trtllm: ModuleType,
) -> None:
    _, app = _fake_engine(fake_trtllm)
    async with serve(app) as engine, aiohttp.ClientSession() as http:
        mesh = MeshSettings(workers=(WorkerSpec(engine.url, engine.url),), health_interval=0.1)
        async with serve(build_router_app(mesh)) as front:

            async def down() -> str | None:
                row = (await _rows(http, front.url))[engine.url]
                return row["reason"] if row["state"] == "down" else None

            reason = await _until(down, "the worker down")
    assert "a trtllm-serve (it has POST /kv_cache_events)" in reason, reason
    assert f"`kvmesh events trtllm {engine.url}`" in reason, reason
    assert "kv_events_endpoints and block_size it prints" in reason, reason


async def test_blocks_of_another_size_stop_the_command_naming_the_size(fake_trtllm: ModuleType) -> None:
    """The engine stores blocks of 4 tokens; told 8, the command would publish nothing (every block
    would look like a prompt's tail). It stops, saying which size to give."""
    _, app = _fake_engine(fake_trtllm)
    async with (
        serve(app) as engine,
        aiohttp.ClientSession() as http,
        bridge(engine.url, "--block-size", "8") as b,
    ):
        await b.entry()
        async with http.post(engine.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}) as r:
            assert r.status == 200
        assert await asyncio.wait_for(b.proc.wait(), 30) == 2
        assert b.proc.stderr is not None
        said = (await b.proc.stderr.read()).decode()
    assert "stores blocks of 4 tokens, not --block-size 8: give --block-size 4" in said, said


async def test_ranks_past_dp_size_stop_the_command(fake_trtllm: ModuleType) -> None:
    _, app = _fake_engine(fake_trtllm, enable_attention_dp=True, tensor_parallel_size=2)
    async with serve(app) as engine, bridge(engine.url, "--block-size", str(BS)) as b:
        assert await asyncio.wait_for(b.proc.wait(), 30) == 2  # (the start-up events of rank 1)
        assert b.proc.stderr is not None
        said = (await b.proc.stderr.read()).decode()
    assert "sent events of attention-DP rank 1: give --dp-size 2" in said, said


async def test_two_attention_dp_ranks_publish_on_their_own_sockets(fake_trtllm: ModuleType) -> None:
    engine, app = _fake_engine(fake_trtllm, enable_attention_dp=True, tensor_parallel_size=2)
    async with (
        serve(app) as server,
        aiohttp.ClientSession() as http,
        bridge(server.url, "--block-size", str(BS), "--dp-size", "2") as b,
    ):
        entry = await b.entry()
        assert len(entry["kv_events_endpoints"]) == len(set(entry["kv_events_endpoints"])) == 2
        for _ in range(2):  # (the fake spreads requests over its ranks in turn)
            async with http.post(server.url + "/v1/completions", json={"prompt": PROMPT}) as r:
                assert r.status == 200

        async def drained() -> bool:
            return not engine._queue

        await _until(drained, "the engine's queue drained by the command")
        summary = await b.stop()
    assert summary["last_seq"] == [0, 0], summary  # (one batch on each rank's own socket)
    assert summary["capacity_blocks"] == {"0": 64, "1": 64}, summary


async def test_a_server_without_the_route_stops_the_command() -> None:
    bare = Starlette(routes=[Route("/health", lambda _: Response(status_code=200))])
    async with serve(bare) as server, bridge(server.url) as b:
        assert await asyncio.wait_for(b.proc.wait(), 30) == 2
        assert b.proc.stderr is not None
        said = (await b.proc.stderr.read()).decode()
    assert f"{server.url} answers POST /kv_cache_events with HTTP 404: it is no trtllm-serve" in said, said


async def test_answers_that_are_no_event_list_are_waited_out(fake_trtllm: ModuleType) -> None:
    """A server that answers the route with something other than a list of events (no JSON, an
    object, a 500) is treated as not answering: said once, polled every second, and followed again
    when it answers; what it then sends is published."""
    engine, _ = _fake_engine(fake_trtllm)
    answers: list[Response] = [
        Response(b"<html>busy</html>", status_code=200),
        Response(b'{"events": []}', status_code=200, media_type="application/json"),
        Response(b"oops", status_code=500),
    ]

    async def kv_cache_events(_: Any) -> Response:
        if answers:
            return answers.pop(0)
        events = []
        while engine._queue:
            events.append(engine._queue.popleft())
        return Response(json.dumps(events).encode(), media_type="application/json")

    stand_in = Starlette(routes=[Route("/kv_cache_events", kv_cache_events, methods=["POST"])])
    engine.generate_async(PROMPT)  # (stored before the command starts: queued with the start-up event)
    async with serve(stand_in) as server, bridge(server.url, "--block-size", str(BS)) as b:
        said = await b.until("until it answers")
        assert "answered no JSON" in said, said
        await b.until("answers again")

        async def drained() -> bool:
            return not engine._queue and not answers

        await _until(drained, "the queue drained after the bad answers")
        summary = await b.stop()
    assert not any("until it answers" in line for line in b.lines[b.lines.index(said) + 1 :])  # (said once)
    assert summary["events"] == 2 and summary["bridged"] == 1 and summary["last_seq"] == [0], summary


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (
            [
                "--endpoint",
                "tcp://127.0.0.1:6000",
                "--replay-endpoint",
                "tcp://127.0.0.1:6001",
                "--dp-size",
                "2",
            ],
            "6000 (events) and 6001 (replay) overlap over 2 attention-DP ranks",
        ),
        (
            ["--endpoint", "tcp://127.0.0.1:0", "--replay-endpoint", "tcp:/x"],
            "cannot bind KV-event socket to 'tcp:/x'",
        ),
        (["--endpoint", "tcp://127.0.0.1:65535", "--dp-size", "2"], "65535 + 1 ranks is past 65535"),
    ],
)
def test_endpoints_that_cannot_serve_every_rank_are_refused(flags: list[str], said: str) -> None:
    import subprocess

    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvmesh",
            "events",
            "trtllm",
            "http://127.0.0.1:9",
            "--replay-endpoint",
            "none",
            *flags,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert said in done.stderr, done.stderr


def _stored(*sizes: int) -> dict[str, Any]:
    blocks = [{"block_hash": i, "tokens": [{"token_id": t} for t in range(n)]} for i, n in enumerate(sizes)]
    return {"event_id": 0, "data": {"type": "stored", "parent_hash": None, "blocks": blocks}}


@pytest.mark.parametrize(
    ("sizes", "seen"),
    [((4, 4, 3), None), ((3,), None), ((8,), 8), ((2, 2, 1), 2), ((4, 4, 4), None), ((4, 5), 5)],
)
def test_the_block_size_the_events_show(sizes: tuple[int, ...], seen: int | None) -> None:
    assert block_size_seen([_stored(*sizes)], 4) == seen


@settings(max_examples=300, deadline=None)
@given(ANY_JSON)
def test_any_answer_is_read_without_a_fault(answer: Any) -> None:
    """Whatever a server answers to ``POST /kv_cache_events``: the checks name a mismatch or pass,
    and the converter publishes what it can and counts the rest; nothing else is raised."""
    events = answer if isinstance(answer, list) else [answer]
    seen = block_size_seen(events, 4)
    assert seen is None or (isinstance(seen, int) and seen > 0)
    with contextlib.suppress(ConfigError):
        check_events(events, argparse.Namespace(url="http://e", block_size=4, dp_size=1))
    converted = EventConverter(4).convert(events)
    assert all(isinstance(rank, int) for rank, _ in converted)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.fixed_dictionaries(
            {
                "event_id": st.integers(0, 5),
                "attention_dp_rank": st.one_of(
                    st.none(), st.integers(-2, 3), st.booleans(), st.text(max_size=2)
                ),
                "data": st.fixed_dictionaries(
                    {
                        "type": st.sampled_from(["stored", "removed", "created", "updated", "x"]),
                        "parent_hash": st.one_of(st.none(), st.integers(), st.text(max_size=20)),
                        "blocks": st.lists(
                            st.fixed_dictionaries(
                                {
                                    "block_hash": st.one_of(st.none(), st.integers(), st.text(max_size=20)),
                                    "tokens": st.lists(st.integers(0, 9), max_size=6),
                                }
                            ),
                            max_size=3,
                        ),
                        "block_hashes": st.lists(st.integers(), max_size=3),
                    }
                ),
            }
        ),
        max_size=8,
    )
)
def test_near_miss_events_are_read_without_a_fault(events: list[dict[str, Any]]) -> None:
    """Events shaped like TensorRT-LLM's with wrong values in them (negative or text ranks, hashes
    of every kind, short and long blocks)."""
    with contextlib.suppress(ConfigError):
        check_events(events, argparse.Namespace(url="http://e", block_size=4, dp_size=2))
    EventConverter(4).convert(events)
