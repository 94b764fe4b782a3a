"""The servers the fuzz suite attacks, on loopback in a background event loop, a plain blocking
HTTP client for hypothesis (whose tests are synchronous), the suite's hypothesis settings and its
report of figures.

Two targets: the standalone router (``kvmesh.router.asgi.standalone``) in front of two mock
engines following their KV events, and a mesh of two mock engines embedding the middleware."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import time
from collections import Counter
from collections.abc import AsyncIterator, Container, Iterator
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, settings

from kvmesh.commands.demo import start_mesh
from kvmesh.mock.config import MockConfig
from kvmesh.mock.testing import run_mock
from kvmesh.router.asgi.standalone import build_router_app
from kvmesh.router.core.config import RouterConfig
from kvmesh.router.mesh.settings import MeshSettings, WorkerSpec
from tests.router.servers import Loop, serve

MOCK = {"block_size": 16, "num_blocks": 4096, "speedup": 1000.0, "max_model_len": 4096}


@dataclass
class Target:
    """A router to send cases to, and what to check afterwards."""

    url: str
    engines: list[Any]  # MockEngine
    engine_urls: list[str]
    """Where each engine serves its worker RPCs (embedded: the same server as the router)."""
    statuses: Counter[int] = field(default_factory=Counter)

    def post(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        return self.call("POST", path, body, headers)

    def call(
        self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None, url: str = ""
    ) -> tuple[int, bytes]:
        """One request to the router, or to ``url`` (an engine's)."""
        host, port = (url or self.url).removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            conn.request(
                method, path, body=body, headers={"content-type": "application/json", **(headers or {})}
            )
            response = conn.getresponse()
            data = response.read()
        finally:
            conn.close()
        self.statuses[response.status] += 1
        return response.status, data

    def get_json(self, path: str) -> Any:
        host, port = self.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            conn.request("GET", path)
            response = conn.getresponse()
            assert response.status == 200, response.status
            return json.loads(response.read())
        finally:
            conn.close()

    def load(self) -> int:
        return sum(row["active_requests"] for row in self.get_json("/kvmesh/workers")["workers"])

    def engine_running(self) -> int:
        return sum(e.scheduler.num_running + e.scheduler.num_waiting for e in self.engines)

    def settled(self) -> None:
        """Wait until the router's load is back to 0 and nothing runs on the engines."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.load() == 0 and self.engine_running() == 0:
                return
            time.sleep(0.05)
        raise AssertionError(f"load {self.load()}, engine requests {self.engine_running()} after the cases")


@contextlib.asynccontextmanager
async def _standalone() -> AsyncIterator[Target]:
    async with contextlib.AsyncExitStack() as stack:
        mocks = [await stack.enter_async_context(run_mock(**{**MOCK, "seed": i})) for i in range(2)]
        settings = MeshSettings(
            workers=tuple(WorkerSpec(m.base_url, m.base_url) for m in mocks),
            router=RouterConfig(),
            health_interval=0.5,
            body_read_timeout=5.0,
        )
        front = await stack.enter_async_context(serve(build_router_app(settings)))
        yield Target(front.url, [m.engine for m in mocks], [m.base_url for m in mocks])


@contextlib.asynccontextmanager
async def _embedded() -> AsyncIterator[Target]:
    async with start_mesh(2, RouterConfig(), MockConfig(**MOCK)) as nodes:
        yield Target(nodes[0].url, [n.engine for n in nodes], [n.url for n in nodes])


@contextlib.contextmanager
def running(kind: str) -> Iterator[Target]:
    loop = Loop()
    try:
        yield loop.enter(_standalone() if kind == "standalone" else _embedded())
    finally:
        loop.close()


def examples(default: int) -> int:
    """Cases per fuzz test: ``KVMESH_FUZZ_EXAMPLES`` (``make fuzz`` sets tens of thousands)."""
    return int(os.environ.get("KVMESH_FUZZ_EXAMPLES", default))


def check_answer(status: int, data: bytes, what: str, named: Container[int] | None = None) -> None:
    """No 5xx; a 4xx is an OpenAI error with a message, whose ``param`` names the field where its
    status is in ``named`` (every 4xx when None). ``what``: the case, for the failure message."""
    assert status < 500, f"HTTP {status} for {what[:300]}: {data[:300]!r}"
    if status >= 400:
        error = json.loads(data)["error"]
        assert error["message"], error
        if named is None or status in named:
            assert error["param"], f"HTTP {status} names no field for {what[:200]}: {error}"


FUZZ = settings(
    max_examples=examples(60),
    deadline=None,
    derandomize="KVMESH_FUZZ_EXAMPLES" not in os.environ,  # make test: the same cases every run
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    database=None,
)


@contextlib.contextmanager
def reported(t: Target, surface: str) -> Iterator[None]:
    """Append the figures of the cases run inside to ``KVMESH_FUZZ_REPORT`` (if set): statuses,
    5xx, the process's RSS before and after, seconds."""
    rss_before = rss_kib()
    started = time.monotonic()
    yield
    out = os.environ.get("KVMESH_FUZZ_REPORT")
    if out:
        row = {
            "target": t.url,
            "path": surface,
            "cases": sum(t.statuses.values()),
            "statuses": dict(sorted(t.statuses.items())),
            "http_5xx": sum(n for s, n in t.statuses.items() if s >= 500),
            "rss_kib_before": rss_before,
            "rss_kib_after": rss_kib(),
            "seconds": round(time.monotonic() - started, 1),
        }
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")
    t.statuses.clear()


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0
