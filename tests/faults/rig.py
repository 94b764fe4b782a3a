"""A standalone router in front of real mock engines (the app ``run_mock`` serves, started here
so a test can crash and restart one on its addresses) on loopback, with a relay on each engine's KV
event stream so a test can drop, duplicate, reorder or garble messages, or cut the stream while the
engine's HTTP keeps answering."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvmesh.mock.config import MockConfig
from kvmesh.mock.engine import MockEngine
from kvmesh.mock.server import build_app
from kvmesh.router.asgi.standalone import build_router_app
from kvmesh.router.core.config import RouterConfig
from kvmesh.router.mesh.settings import MeshSettings, WorkerSpec
from tests.events.eventkit import LossyRelay
from tests.router.servers import Server, serve

MOCK = {"block_size": 16, "num_blocks": 2048, "speedup": 20.0}


@dataclass
class Engine:
    """One mock engine on loopback that a test can crash and restart on the same addresses."""

    config: MockConfig
    engine: MockEngine
    server: Server
    stack: contextlib.AsyncExitStack

    @property
    def url(self) -> str:
        return self.server.url

    @classmethod
    async def start(cls, config: MockConfig, sock: socket.socket | None = None) -> Engine:
        engine = MockEngine(config)
        stack = contextlib.AsyncExitStack()
        server = await stack.enter_async_context(serve(build_app(engine), sock))
        stack.push_async_callback(engine.stop)
        assert engine.events_endpoint is not None and engine.replay_endpoint is not None
        bound = config.replace(
            kv_events_endpoint=engine.events_endpoint, kv_replay_endpoint=engine.replay_endpoint
        )
        return cls(bound, engine, server, stack)

    async def crash(self) -> None:
        """Gone at once, like a killed process: connections reset, the port refuses."""
        self.server.crash()
        await self.stack.aclose()

    async def restart(self) -> Engine:
        """A fresh engine (empty cache, event sequence from 0) on the same HTTP and event addresses."""
        port = int(self.url.rsplit(":", 1)[1])
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        return await Engine.start(self.config, sock)


@dataclass
class Rig:
    front: Server
    engines: list[Engine]
    relays: list[LossyRelay]
    http: aiohttp.ClientSession

    async def chat(self, text: str, **extra: Any) -> tuple[int, str]:
        body: dict[str, Any] = {"model": MockConfig().model, "messages": [{"role": "user", "content": text}]}
        body["max_tokens"] = 4
        body.update(extra)
        async with self.http.post(self.front.url + "/v1/chat/completions", json=body) as r:
            return r.status, await r.text()

    async def workers(self) -> dict[str, dict[str, Any]]:
        async with self.http.get(self.front.url + "/kvmesh/workers") as r:
            assert r.status == 200
            return {row["url"]: row for row in (await r.json())["workers"]}

    async def load(self) -> int:
        return sum(row["active_requests"] for row in (await self.workers()).values())

    def engine_running(self) -> int:
        return sum(e.engine.scheduler.num_running + e.engine.scheduler.num_waiting for e in self.engines)

    async def metrics(self) -> str:
        async with self.http.get(self.front.url + "/metrics") as r:
            return await r.text()

    async def index_matches(self, i: int) -> bool:
        """The router's index of engine ``i`` holds as many blocks as the engine's cache."""
        row = (await self.workers())[self.engines[i].url]
        return bool(row["indexed_blocks"] == engine_blocks(self.engines[i].engine))


def engine_blocks(engine: MockEngine) -> int:
    """Blocks the engine holds in its prefix cache now (its own kv_state)."""
    ranks = engine.kv_state()["ranks"]
    return sum(len(e["block_hashes"]) for r in ranks for e in r["events"] if e["type"] == "BlockStored")


@contextlib.asynccontextmanager
async def rig(n: int = 2, *, router: RouterConfig | None = None, **mock: Any) -> AsyncIterator[Rig]:
    async with contextlib.AsyncExitStack() as stack:
        engines = []
        for i in range(n):
            config = MockConfig(**{**MOCK, "seed": i, **mock}).replace(
                kv_events_endpoint="tcp://127.0.0.1:0", kv_replay_endpoint="tcp://127.0.0.1:0"
            )
            engine = await Engine.start(config)
            stack.push_async_callback(lambda e=engine: _close(e))
            engines.append(engine)
        relays = []
        for e in engines:
            relay = LossyRelay(e.config.kv_events_endpoint or "", "tcp://127.0.0.1:*", drop=lambda seq: False)
            stack.callback(relay.close)
            relays.append(relay)
        specs = tuple(
            WorkerSpec(
                e.url,
                e.url,
                kv_events_endpoints=(r.endpoint,),
                kv_replay_endpoints=(e.config.kv_replay_endpoint,),
            )
            for e, r in zip(engines, relays, strict=True)
        )
        settings = MeshSettings(
            workers=specs, router=router or RouterConfig(), health_interval=0.2, health_failures=1
        )
        front = await stack.enter_async_context(serve(build_router_app(settings)))
        http = await stack.enter_async_context(aiohttp.ClientSession())
        r = Rig(front, engines, relays, http)
        await until(lambda: _all_up(r))
        await asyncio.sleep(0.3)  # the SUB sockets join the relays' PUB sockets
        yield r


async def _close(engine: Engine) -> None:
    with contextlib.suppress(Exception):
        await engine.stack.aclose()


async def _all_up(r: Rig) -> bool:
    return all(row["state"] == "up" for row in (await r.workers()).values())


async def until(check: Any, timeout: float = 10.0) -> None:
    """Poll ``check`` (sync or async) until it holds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        got = check()
        if asyncio.iscoroutine(got):
            got = await got
        if got:
            return
        if loop.time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.05)
