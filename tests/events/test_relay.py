"""``kvmesh events relay``: a ZMQ KV-event publisher -> the relay (its own process) -> NATS -> a
router that found the engine in the worker bucket; its index matches what was published, including
the batches published before the relay started (a gap the relay repairs by replay)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from kvmesh.events.nats_link import SEQ_HEADER, NatsOptions, import_nats
from kvmesh.events.publisher import KvEventPublisher
from kvmesh.events.wire import BlockStored, decode_batch
from kvmesh.mock.testing import run_mock
from kvmesh.router.asgi.standalone import build_router_app
from kvmesh.router.mesh.settings import MeshSettings
from tests.events.natskit import HOST, nats_server
from tests.router.servers import serve

BLOCK = 16
ROOT = Path(__file__).resolve().parents[2]


def _health_only() -> Starlette:
    """An engine without kvmesh's plugin: /health answers, /kvmesh/info does not exist."""

    async def health(_request: Any) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    return Starlette(routes=[Route("/health", health)])


def _publish(pub: KvEventPublisher, first: int, count: int) -> None:
    """``count`` batches, each one chain of two blocks; every third batch evicts its second block."""
    for i in range(first, first + count):
        base = 10_000 * (i + 1)
        pub.stored([base, base + 1], [i * 2 * BLOCK + t for t in range(2 * BLOCK)])
        if i % 3 == 0:
            pub.removed([base + 1])
        pub.flush()


def _expected_blocks(n: int) -> int:
    return sum(1 if i % 3 == 0 else 2 for i in range(n))


async def _rows(http: aiohttp.ClientSession, front: str) -> dict[str, dict[str, Any]]:
    async with http.get(front + "/kvmesh/workers") as r:
        return {row["url"]: row for row in (await r.json())["workers"]}


async def _stream(nats_url: str, subject: str, count: int) -> list[tuple[int, bytes]]:
    """The first ``count`` messages of ``subject`` in the event stream: (seq header, payload)."""
    nats = import_nats()
    nc = await nats.connect(servers=[nats_url])
    try:
        js = nc.jetstream()
        sub = await js.subscribe(subject, stream=NatsOptions((nats_url,)).stream, ordered_consumer=True)
        got = []
        for _ in range(count):
            msg = await sub.next_msg(timeout=5)
            got.append((int(msg.headers[SEQ_HEADER]), msg.data))
        await sub.unsubscribe()
        return got
    finally:
        await nc.close()


async def test_relay_carries_a_zmq_stream_into_a_nats_routers_index() -> None:
    early, live = 30, 20
    with nats_server() as node:
        pub = KvEventPublisher(
            f"tcp://{HOST}:0", replay_endpoint=f"tcp://{HOST}:0", block_size=BLOCK, bind=True
        )
        relay: subprocess.Popen[str] | None = None
        try:
            _publish(pub, 0, early)  # before the relay exists: it must replay these
            async with aiohttp.ClientSession() as http, serve(_health_only()) as engine:
                relay = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "kvmesh",
                        "events",
                        "relay",
                        pub.endpoint,
                        "--replay-endpoint",
                        str(pub.replay_endpoint),
                        "--nats",
                        node.url,
                        "--register",
                        engine.url,
                        "--no-engine-info",
                        "--nats-worker-ttl",
                        "2",
                        "--fact",
                        f"block_size={BLOCK}",
                        "--fact",
                        "max_num_batched_tokens=2048",
                        "--fact",
                        "total_kv_blocks=4096",
                        "--fact",
                        "model=relayed",
                        "--fact",
                        "tokens_api=true",
                    ],
                    stderr=subprocess.PIPE,
                    text=True,
                    cwd=ROOT,
                    env={**os.environ, "PYTHONPATH": str(ROOT)},
                )
                assert relay.stderr is not None
                started = await asyncio.to_thread(relay.stderr.readline)
                assert " -> nats:kvmesh.events." in started, started
                settings = MeshSettings(event_plane=node.url, nats_worker_ttl=2.0, health_interval=0.2)
                async with serve(build_router_app(settings)) as front:
                    for i in range(live):  # live, while the router discovers the engine
                        _publish(pub, early + i, 1)
                        await asyncio.sleep(0.02)
                    want = _expected_blocks(early + live)
                    row: dict[str, Any] = {}
                    for _ in range(300):
                        row = (await _rows(http, front.url)).get(engine.url, {})
                        if row.get("state") == "up" and row.get("indexed_blocks") == want:
                            break
                        await asyncio.sleep(0.05)
                    assert row.get("state") == "up", row
                    assert row["tokens_api"] is True  # (the registration's fact: no /kvmesh/info)
                    # Every block published, early or live, minus the evicted ones; only NATS fed it
                    # (the engine has no /kvmesh/info, so no kv_state cold start).
                    assert row["indexed_blocks"] == want, row

            # The stream holds the engine's own sequence numbers 0.. in order, each batch as published.
            subject = NatsOptions((node.url,)).events_subject(engine.url, 0)
            messages = await _stream(node.url, subject, early + live)
            assert [seq for seq, _ in messages] == list(range(early + live))
            first = decode_batch(messages[0][1])
            assert isinstance(first.events[0], BlockStored) and first.events[0].block_hashes == [
                10_000,
                10_001,
            ]
        finally:
            if relay is not None and relay.poll() is None:
                relay.send_signal(signal.SIGINT)
            pub.close(timeout=0.2)
        assert relay is not None and relay.stderr is not None
        assert relay.wait(15) == 0
        summary = relay.stderr.read().strip().splitlines()[-1]
        stats = json.loads(summary.split("stopped ", 1)[1])
        assert stats["relayed"] == early + live and stats["stored"] == early + live, stats
        assert stats["gaps"] >= 1 and stats["unrecoverable"] == 0, stats  # the early batches, by replay


async def test_relay_reads_a_stock_engines_endpoints_and_facts_from_its_url() -> None:
    """``kvmesh events relay --nats ... --register URL`` with no ENDPOINT: a stock vLLM's routes
    (served by ``kvmesh mock --no-worker-rpc``) give the relay its publisher and replay endpoints
    and the registration its block size, cache size and backend, so the NATS router routes to it
    with nothing written by hand. Before, the relay wanted each endpoint, and ``--no-engine-info``
    with a ``--fact`` per fact for an engine without ``/kvmesh/info``."""
    with nats_server() as node:
        async with (
            run_mock(block_size=BLOCK, speedup=50.0, worker_rpc=False) as mock,
            aiohttp.ClientSession() as http,
        ):
            relay = subprocess.Popen(
                [sys.executable, "-m", "kvmesh", "events", "relay", "--nats", node.url,
                 "--register", mock.base_url, "--nats-worker-ttl", "2"],
                stderr=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
            )  # fmt: skip
            try:
                assert relay.stderr is not None
                started = await asyncio.to_thread(relay.stderr.readline)
                assert started.startswith(f"kvmesh events relay: {mock.engine.events_endpoint} -> nats:"), (
                    started
                )
                settings = MeshSettings(event_plane=node.url, nats_worker_ttl=2.0, health_interval=0.2)
                async with serve(build_router_app(settings)) as front:
                    row: dict[str, Any] = {}
                    for _ in range(300):
                        row = (await _rows(http, front.url)).get(mock.base_url, {})
                        if row.get("state") == "up":
                            break
                        await asyncio.sleep(0.05)
                    assert (row.get("state"), row.get("backend"), row.get("block_size")) == (
                        "up",
                        "vllm",
                        BLOCK,
                    ), row
                    body = {"model": mock.config.model, "prompt": "relayed " * 60, "max_tokens": 1}
                    async with http.post(front.url + "/v1/completions", json=body) as r:
                        assert r.status == 200, await r.text()
                    for _ in range(300):
                        row = (await _rows(http, front.url))[mock.base_url]
                        if row["indexed_blocks"] > 0:
                            break
                        await asyncio.sleep(0.05)
                    assert row["indexed_blocks"] > 0, row
            finally:
                relay.send_signal(signal.SIGINT)
                assert relay.wait(15) == 0
