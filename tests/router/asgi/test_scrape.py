"""An engine's own multiprocess ``/metrics`` behind the middleware carries kvmesh's live gauges.

The engine here serves ``/metrics`` as SGLang and vLLM do, with prometheus-client's ASGI app
over a registry of its own (Mount with the engines' regex), so the live collector in the default
registry is not in it. ``PROMETHEUS_MULTIPROC_DIR`` set says the engine runs that way.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import re
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from prometheus_client import CollectorRegistry, Counter, make_asgi_app
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.routing import Mount

from kvmesh.router.asgi.middleware import KvMeshMiddleware
from kvmesh.router.asgi.scrape import with_gauges
from kvmesh.router.asgi.standalone import build_router_app
from kvmesh.router.core.config import RouterConfig
from kvmesh.router.mesh.metrics import get_metrics
from kvmesh.router.mesh.settings import MeshSettings, WorkerSpec
from tests.router.engines import EngineState, engine_app
from tests.router.servers import bound_socket, serve

LIVE = "kvmesh_queue_pending_requests"


@contextlib.asynccontextmanager
async def engine(*, own_metrics: bool = True) -> AsyncIterator[tuple[str, str]]:
    """One engine embedding the middleware, its ``/metrics`` a registry of its own (or none):
    (url, the mesh's replica label)."""
    registry = CollectorRegistry()
    Counter("engine_probe", "the engine's own metric", registry=registry).inc(3)
    routes = []
    if own_metrics:
        metrics = Mount("/metrics", make_asgi_app(registry=registry))
        metrics.path_regex = re.compile("^/metrics(?P<path>.*)$")  # as SGLang and vLLM mount it
        routes.append(metrics)
    routes.append(Mount("/", engine_app(EngineState("self"))))
    sock = bound_socket()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    settings = MeshSettings(
        workers=(WorkerSpec(url, url),), self_url=url, router=RouterConfig(use_kv_events=False)
    )
    app = KvMeshMiddleware(Starlette(routes=routes), settings=settings)
    async with serve(app, sock) as server, aiohttp.ClientSession() as http:

        async def registered() -> bool:
            async with http.get(url + "/kvmesh/workers") as r:
                return bool((await r.json())["workers"])

        for _ in range(250):
            if await registered():
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("the engine did not register itself")
        yield server.url, app.mesh.replica


def families(text: str) -> dict[str, list[dict[str, str]]]:
    """family name -> the label sets of its samples (raises on a malformed exposition)."""
    return {f.name: [s.labels for s in f.samples] for f in text_string_to_metric_families(text)}


@pytest.fixture
def multiprocess(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))


@pytest.mark.usefixtures("multiprocess")
@pytest.mark.parametrize("path", ["/metrics", "/metrics/"])
async def test_the_engines_text_answer_gets_the_live_gauges_once(
    http: aiohttp.ClientSession, path: str
) -> None:
    plain = {"Accept-Encoding": "identity"}  # aiohttp asks for gzip unless told
    async with engine() as (url, replica), http.get(url + path, headers=plain) as r:
        assert r.status == 200 and "content-encoding" not in r.headers
        body = await r.read()
        assert int(r.headers["content-length"]) == len(body)
    text = body.decode()
    found = families(text)
    assert found["engine_probe"]  # the engine's own answer is kept
    assert {"replica": replica} in found[LIVE]
    assert {"replica": replica, "worker": url, "dp_rank": "0"} in found["kvmesh_worker_active_decode_blocks"]
    assert text.count(f"# TYPE {LIVE} gauge") == 1


@pytest.mark.usefixtures("multiprocess")
async def test_a_gzip_answer_stays_gzip() -> None:
    zipped = {"Accept-Encoding": "gzip"}
    async with (
        engine() as (url, replica),
        aiohttp.ClientSession(auto_decompress=False) as raw,
        raw.get(url + "/metrics", headers=zipped) as r,
    ):
        assert r.headers["content-encoding"] == "gzip"
        body = await r.read()
        assert int(r.headers["content-length"]) == len(body)
    found = families(gzip.decompress(body).decode())
    assert found["engine_probe"] and {"replica": replica} in found[LIVE]


@pytest.mark.usefixtures("multiprocess")
async def test_an_openmetrics_answer_stays_valid_openmetrics(http: aiohttp.ClientSession) -> None:
    accept = {"Accept": "application/openmetrics-text; version=1.0.0"}
    async with engine() as (url, replica), http.get(url + "/metrics", headers=accept) as r:
        assert r.headers["content-type"].startswith("application/openmetrics-text")
        text = await r.text()
    assert text.endswith("# EOF\n") and text.count("# EOF") == 1
    found = {f.name: [s.labels for s in f.samples] for f in parse_openmetrics(text)}
    assert found["engine_probe"] and {"replica": replica} in found[LIVE]


@pytest.mark.usefixtures("multiprocess")
async def test_a_name_filter_keeps_only_the_gauges_asked_for(http: aiohttp.ClientSession) -> None:
    async with engine() as (url, replica), http.get(url + "/metrics", params={"name[]": LIVE}) as r:
        found = families(await r.text())
    assert set(found) == {LIVE} and {"replica": replica} in found[LIVE]


@pytest.mark.usefixtures("multiprocess")
async def test_an_engine_without_metrics_still_answers_404(http: aiohttp.ClientSession) -> None:
    async with engine(own_metrics=False) as (url, _), http.get(url + "/metrics") as r:
        assert r.status == 404
        assert LIVE not in await r.text()


async def test_without_a_multiprocess_directory_the_engines_answer_is_untouched(
    http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    async with engine() as (url, _), http.get(url + "/metrics") as r:
        found = families(await r.text())
    assert "engine_probe" in found and LIVE not in found


@pytest.mark.usefixtures("multiprocess")
async def test_an_answer_that_has_them_is_not_given_them_twice(http: aiohttp.ClientSession) -> None:
    # the standalone router serves the default registry, live collector included
    settings = MeshSettings(
        workers=(WorkerSpec("http://127.0.0.1:9", "w"),), router=RouterConfig(use_kv_events=False)
    )
    async with serve(build_router_app(settings)) as front, http.get(front.url + "/metrics") as r:
        text = await r.text()
    assert text.count(f"# TYPE {LIVE} gauge") == 1
    families(text)


@pytest.mark.parametrize("body", [b"not gzip at all", b"\x1f\x8b\x08\x00broken"])
def test_a_body_that_is_not_the_gzip_it_claims_is_sent_unchanged(body: bytes) -> None:
    headers = [(b"content-type", b"text/plain; version=0.0.4"), (b"content-encoding", b"gzip")]
    assert with_gauges(headers, body, get_metrics(), []) is None
