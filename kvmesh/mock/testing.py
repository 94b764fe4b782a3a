"""Run a real mock engine on loopback from async code (tests, benchmarks, examples)::

    async with run_mock(num_blocks=256, block_size=16, speedup=10) as mock:
        client = openai.AsyncOpenAI(base_url=mock.base_url + "/v1", api_key="none")
        ...
        mock.events_endpoint, mock.replay_endpoint   # where its KV events are published
        mock.engine                                  # the MockEngine itself

The HTTP server (uvicorn, in the caller's event loop) and the KV-event sockets all bind to
``127.0.0.1`` on free ports unless told otherwise; everything is closed on exit. ``middleware``
wraps the engine's app, e.g. ``[Middleware(KvMeshMiddleware, ...)]``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware

from kvmesh.mock.config import MockConfig
from kvmesh.mock.engine import MockEngine
from kvmesh.mock.server import build_app

HOST = "127.0.0.1"


@dataclass(frozen=True)
class RunningMock:
    engine: MockEngine
    app: Starlette
    host: str
    port: int

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:<port>`` (append ``/v1`` for an OpenAI client)."""
        return f"http://{self.host}:{self.port}"

    @property
    def config(self) -> MockConfig:
        return self.engine.config

    @property
    def events_endpoint(self) -> str | None:
        return self.engine.events_endpoint

    @property
    def replay_endpoint(self) -> str | None:
        return self.engine.replay_endpoint


@contextlib.asynccontextmanager
async def run_mock(
    config: MockConfig | None = None,
    *,
    events: bool = True,
    port: int = 0,
    middleware: Sequence[Middleware] = (),
    startup_timeout: float = 10.0,
    announce_interval: float = 2.0,
    **overrides: Any,
) -> AsyncIterator[RunningMock]:
    """Start a mock engine (config plus ``overrides``, e.g. ``speedup=10``) and its HTTP server.

    With ``events`` (the default) and no endpoints configured, the engine publishes KV events on
    free loopback ports. ``port=0`` picks a free HTTP port. With ``event_plane="nats://..."`` the
    events go to NATS and the mock registers in the worker bucket every ``announce_interval`` s.
    """
    cfg = (config or MockConfig()).replace(**overrides) if overrides else (config or MockConfig()).validate()
    nats = cfg.event_plane != "zmq"
    if events and cfg.kv_events_endpoint is None and not nats:
        cfg = cfg.replace(kv_events_endpoint=f"tcp://{HOST}:0", kv_replay_endpoint=f"tcp://{HOST}:0")
    engine = MockEngine(cfg)
    app = build_app(engine, middleware=middleware)
    server = uvicorn.Server(
        uvicorn.Config(app, host=HOST, port=port, log_level="warning", access_log=False, lifespan="on")
    )
    serving = asyncio.create_task(server.serve(), name="kvmesh-mock-uvicorn")
    try:
        deadline = asyncio.get_running_loop().time() + startup_timeout
        while not server.started:
            if serving.done():
                serving.result()  # raises the start-up error
                raise RuntimeError("the mock's HTTP server exited during start-up")
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"the mock's HTTP server did not start within {startup_timeout} s")
            await asyncio.sleep(0.01)
        bound = server.servers[0].sockets[0].getsockname()[1]
        if nats:  # the NATS event plane: register in the worker bucket, as `kvmesh mock` does
            await engine.announce(f"http://{HOST}:{bound}", interval=announce_interval)
        yield RunningMock(engine=engine, app=app, host=HOST, port=bound)
    finally:
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await serving
        await engine.stop()  # the lifespan stops it too; this covers a failed start-up
