"""The standalone router's pooling requests (kvmesh/router/asgi/pooling.py), over HTTP: embeddings,
scores and reranking, sent to the least loaded worker that has the path.

Stand-in engines on loopback: one with vLLM's pooling paths, one with SGLang's. Each keeps what it
was asked, can hold an answer until the test lets it go, notices a client that left, and reports
its running requests in vLLM's ``/metrics`` gauge."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvmesh.mock.testing import run_mock
from kvmesh.router.asgi.standalone import build_router_app
from kvmesh.router.core.config import RouterConfig
from kvmesh.router.mesh.settings import MeshSettings, WorkerSpec
from tests.router.servers import Server, serve

VLLM_PATHS = ("/v1/embeddings", "/v2/rerank", "/score", "/pooling")
SGLANG_PATHS = ("/v1/embeddings", "/encode", "/v1/rerank")


@dataclass
class Engine:
    name: str
    paths: tuple[str, ...]
    asked: list[tuple[str, str, Any, str | None]] = field(default_factory=list)
    hold: asyncio.Event | None = None
    """While set to an unset event, each answer waits for it."""
    holding: int = 0
    abandoned: int = 0
    """Requests whose client went away while they were held."""
    running_gauge: float = 0.0

    def app(self) -> Starlette:
        async def info(request: Request) -> Response:
            return JSONResponse({"backend": "vllm", "model": "m", "block_size": 16})

        async def models(request: Request) -> Response:
            return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model"}]})

        async def metrics(request: Request) -> Response:
            text = (
                "# TYPE vllm:num_requests_running gauge\n"
                f'vllm:num_requests_running{{engine="0",model_name="m"}} {self.running_gauge}\n'
                "# TYPE vllm:num_requests_waiting gauge\n"
                'vllm:num_requests_waiting{engine="0",model_name="m"} 0.0\n'
            )
            return Response(text, media_type="text/plain")

        async def pool(request: Request) -> Response:
            if request.method == "GET":
                body = None
            elif (kind := request.headers.get("content-type", "")).startswith("multipart/form-data"):
                body = (kind, await request.body())  # (speech to text: a form, kept as it came)
            else:
                body = await request.json()
            self.asked.append((request.method, request.url.path, body, request.headers.get("authorization")))
            hold = self.hold
            if hold is not None:
                self.holding += 1
                try:
                    while not hold.is_set():
                        if await request.is_disconnected():
                            self.abandoned += 1
                            return Response(status_code=499)
                        await asyncio.sleep(0.01)
                finally:
                    self.holding -= 1
            return JSONResponse({"object": "list", "data": [{"embedding": [0.5]}], "served_by": self.name})

        routes = [
            Route("/kvmesh/info", info),
            Route("/health", models),
            Route("/v1/models", models),
            Route("/metrics", metrics),
        ]
        routes += [Route(path, pool, methods=["GET", "POST", "PUT"]) for path in self.paths]
        return Starlette(routes=routes)


@contextlib.asynccontextmanager
async def _fleet(
    *engines: Engine, router: RouterConfig | None = None, **limits: int
) -> AsyncIterator[tuple[Server, aiohttp.ClientSession]]:
    async with contextlib.AsyncExitStack() as stack:
        servers = [await stack.enter_async_context(serve(e.app())) for e in engines]
        settings = MeshSettings(
            workers=tuple(WorkerSpec(s.url, e.name) for s, e in zip(servers, engines, strict=True)),
            router=router or RouterConfig(use_kv_events=False),
            health_interval=0.2,
            **limits,
        )
        front = await stack.enter_async_context(serve(build_router_app(settings)))
        http = await stack.enter_async_context(aiohttp.ClientSession())
        yield front, http


async def _served_by(http: aiohttp.ClientSession, url: str, body: dict[str, Any], **kw: Any) -> str:
    async with http.post(url, json=body, **kw) as r:
        assert r.status == 200, await r.text()
        served: str = (await r.json())["served_by"]
        assert r.headers["x-kvmesh-worker-id"] == served
        return served


async def _counted(http: aiohttp.ClientSession, url: str, route: str, status: int) -> float:
    """``kvmesh_requests_total`` of ``/v1/embeddings`` for ``route`` and ``status`` (the registry is
    the process's: a test reads how much it grew)."""
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    line = f'kvmesh_requests_total{{endpoint="/v1/embeddings",route="{route}",status="{status}"}} '
    return next((float(x[len(line) :]) for x in text.splitlines() if x.startswith(line)), 0.0)


async def _until(condition: Any) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


async def test_an_embedding_request_reaches_a_worker_unchanged_and_its_answer_comes_back() -> None:
    v, s = Engine("v", VLLM_PATHS), Engine("s", SGLANG_PATHS)
    async with _fleet(v, s) as (front, http):
        before = await _counted(http, front.url, "pooling", 200)
        body = {"model": "m", "input": ["a text", "another"], "encoding_format": "float"}
        served = [
            await _served_by(http, front.url + "/v1/embeddings", body, headers={"authorization": "Bearer k"})
        ]
        served.append(await _served_by(http, front.url + "/v1/embeddings", body))
        assert sorted(served) == ["s", "v"]  # (idle workers: taken in turn)
        # a path one engine has: whichever is asked first, the one with it answers
        for _ in range(2):
            rerank = {"model": "m", "query": "q", "documents": ["d1", "d2"]}
            assert await _served_by(http, front.url + "/v2/rerank", rerank) == "v"
        async with http.put(front.url + "/encode", json={"text": "t"}) as r:  # (SGLang's, with a PUT)
            assert r.status == 200 and (await r.json())["served_by"] == "s"
        async with http.post(front.url + "/classify", json={"input": "t"}) as r:
            assert r.status == 404  # (no worker has it: the last 404 is the answer)
        async with http.get(front.url + "/v1/embeddings") as r:
            assert r.status == 405
        assert await _counted(http, front.url, "pooling", 200) == before + 2
    first = (v.asked + s.asked)[0]
    assert first == ("POST", "/v1/embeddings", body, "Bearer k")  # the body and the client's key, as sent
    assert [a[:2] for a in s.asked if a[1] != "/v1/embeddings"] == [("PUT", "/encode")]


async def test_a_body_no_engine_could_read_is_the_clients_400_and_no_worker_is_asked() -> None:
    v = Engine("v", VLLM_PATHS)
    async with _fleet(v) as (front, http):
        for bad in (b"[1]", b"{", b'{"input": ' + b"[" * 5000 + b"]" * 5000 + b"}"):
            async with http.post(front.url + "/v1/embeddings", data=bad) as r:
                assert r.status == 400 and (await r.json())["error"]["param"] == "body"
    assert v.asked == []


async def test_a_pooling_request_goes_to_the_worker_with_fewer_requests_in_flight() -> None:
    a, b = Engine("a", VLLM_PATHS), Engine("b", VLLM_PATHS)
    async with _fleet(a, b) as (front, http):
        body = {"model": "m", "input": "x"}
        a.hold = b.hold = gate = asyncio.Event()
        first = asyncio.create_task(_served_by(http, front.url + "/v1/embeddings", body))
        await _until(lambda: a.holding + b.holding == 1)
        busy, idle = (a, b) if a.holding else (b, a)
        busy.hold = idle.hold = None  # (the idle one answers at once from now on)
        for _ in range(3):  # every one goes to the other worker while the first is in flight
            assert await _served_by(http, front.url + "/v1/embeddings", body) == idle.name
        gate.set()
        assert await first == busy.name


async def test_a_round_robin_router_takes_the_workers_in_turn_whatever_their_load() -> None:
    a, b = Engine("a", VLLM_PATHS), Engine("b", VLLM_PATHS)
    async with _fleet(a, b, router=RouterConfig(router_mode="round-robin")) as (front, http):
        body = {"model": "m", "input": "x"}
        a.hold = b.hold = gate = asyncio.Event()
        first = asyncio.create_task(_served_by(http, front.url + "/v1/embeddings", body))
        await _until(lambda: a.holding + b.holding == 1)
        busy, idle = (a, b) if a.holding else (b, a)
        busy.hold = idle.hold = None
        served = [await _served_by(http, front.url + "/v1/embeddings", body) for _ in range(4)]
        assert served == [idle.name, busy.name] * 2  # (the busy one's turn comes all the same)
        assert busy.holding == 1 and not first.done()  # (its first request is still held)
        gate.set()
        assert await first == busy.name


async def test_a_batch_of_documents_outweighs_queries_in_flight() -> None:
    """Outstanding work is weighed by the bodies' size, not counted in requests: a batch of long
    documents on one engine keeps every query off it, even with more queries held on the other."""
    a, b = Engine("a", VLLM_PATHS), Engine("b", VLLM_PATHS)
    async with _fleet(a, b) as (front, http):
        a.hold = b.hold = gate = asyncio.Event()
        batch = {"model": "m", "input": ["a long document " * 200] * 8}
        held = [asyncio.create_task(_served_by(http, front.url + "/v1/embeddings", batch))]
        await _until(lambda: a.holding + b.holding == 1)
        big, other = (a, b) if a.holding else (b, a)
        for n in (2, 3, 4):  # queries pile up on the other engine, all held there
            query = {"model": "m", "input": f"query {n}"}
            held.append(asyncio.create_task(_served_by(http, front.url + "/v1/embeddings", query)))
            await _until(lambda n=n: big.holding + other.holding == n)
            assert big.holding == 1
        gate.set()
        assert await asyncio.gather(*held) == [big.name] + [other.name] * 3


async def test_a_client_that_leaves_before_the_answer_stops_the_engines_request() -> None:
    a = Engine("a", VLLM_PATHS)
    a.hold = asyncio.Event()
    async with _fleet(a) as (front, http):
        before = await _counted(http, front.url, "disconnected", 499)
        with contextlib.suppress(asyncio.TimeoutError):
            timeout = aiohttp.ClientTimeout(total=0.5)
            async with http.post(front.url + "/v1/embeddings", json={"input": "x"}, timeout=timeout):
                pass
        await _until(lambda: a.abandoned == 1)  # the engine saw its client go
        assert a.holding == 0
        assert await _counted(http, front.url, "disconnected", 499) == before + 1


async def test_a_worker_that_cannot_be_reached_is_passed_over() -> None:
    v = Engine("v", VLLM_PATHS)
    async with contextlib.AsyncExitStack() as going, aiohttp.ClientSession() as http:
        live = await going.enter_async_context(serve(v.app()))
        async with contextlib.AsyncExitStack() as gone_stack:
            gone = await gone_stack.enter_async_context(serve(Engine("gone", VLLM_PATHS).app()))
            settings = MeshSettings(
                workers=(WorkerSpec(live.url, "v"), WorkerSpec(gone.url, "gone")),
                router=RouterConfig(use_kv_events=False),
                health_interval=30.0,  # (no health check sees it go: it stays routable)
            )
            front = await going.enter_async_context(serve(build_router_app(settings)))
            async with http.get(front.url + "/kvmesh/workers") as r:
                assert [w["state"] for w in (await r.json())["workers"]] == ["up", "up"]
        for _ in range(2):  # (each worker is first in turn once)
            assert await _served_by(http, front.url + "/v1/embeddings", {"input": "x"}) == "v"
    assert len(v.asked) == 2


async def test_in_front_of_mock_engines_the_answer_is_the_engines_and_a_client_leaving_aborts_it() -> None:
    """``kvmesh mock`` engines serve vLLM's ``/v1/embeddings``: each input a prefill on the engine,
    one at a time here (slowed down: a batch of long inputs takes seconds, a short one a second)."""
    async with contextlib.AsyncExitStack() as stack:
        mocks = [
            await stack.enter_async_context(
                run_mock(block_size=16, max_num_seqs=1, speedup=0.02, events=False)
            )
            for _ in range(2)
        ]
        settings = MeshSettings(
            workers=tuple(WorkerSpec(m.base_url, f"m{i}") for i, m in enumerate(mocks)),
            router=RouterConfig(use_kv_events=False),
            health_interval=0.2,
        )
        front = await stack.enter_async_context(serve(build_router_app(settings)))
        http = await stack.enter_async_context(aiohttp.ClientSession())
        # a batch of long inputs holds one engine; the next request goes to the other
        batch = {"input": [f"document {i} " + "long " * 400 for i in range(8)]}
        held = asyncio.ensure_future(http.post(front.url + "/v1/embeddings", json=batch))
        await _until(lambda: sum(m.engine.scheduler.num_running for m in mocks) == 1)
        busy = next(i for i, m in enumerate(mocks) if m.engine.scheduler.num_running)
        body = {"input": ["a query", "a document of a few words"], "encoding_format": "base64"}
        async with http.post(front.url + "/v1/embeddings", json=body) as r:
            assert r.status == 200 and r.headers["x-kvmesh-worker-id"] == f"m{1 - busy}"
            through = await r.json()
        async with http.post(mocks[1 - busy].base_url + "/v1/embeddings", json=body) as r:
            direct = await r.json()
        assert through["data"] == direct["data"] and through["usage"] == direct["usage"]  # (unchanged)
        assert not held.done()
        held.cancel()  # the client leaves before the batch's answer
        with contextlib.suppress(asyncio.CancelledError):
            await held
        await _until(lambda: not mocks[busy].engine.scheduler.has_work)  # (aborted, not run for nobody)
        assert mocks[busy].engine.pool.num_used == 0


async def test_speech_to_text_and_scores_on_a_generating_model_are_relayed() -> None:
    """Speech to text takes a form with the audio file, relayed as it came (not refused for not
    being JSON); System One decisions and vLLM's generative scores go like any pooling request."""
    v = Engine("v", ("/v1/audio/transcriptions", "/v1/audio/translations", "/generative_scoring"))
    s = Engine("s", ("/v1/audio/transcriptions", "/v1/systemone"))
    audio = bytes(range(256)) * 64  # (16 KiB of "audio", every byte value)
    async with _fleet(v, s) as (front, http):
        served = []
        for _ in range(2):
            form = aiohttp.FormData()
            form.add_field("file", audio, filename="clip.wav", content_type="audio/wav")
            form.add_field("model", "whisper")
            async with http.post(front.url + "/v1/audio/transcriptions", data=form) as r:
                assert r.status == 200, await r.text()
                served.append((await r.json())["served_by"])
        assert sorted(served) == ["s", "v"]
        form = aiohttp.FormData()
        form.add_field("file", audio, filename="clip.wav", content_type="audio/wav")
        form.add_field("model", "whisper")
        async with http.post(front.url + "/v1/audio/translations", data=form) as r:
            assert r.status == 200 and (await r.json())["served_by"] == "v"
        assert await _served_by(http, front.url + "/v1/systemone", {"model": "m", "candidates": ["a"]}) == "s"
        assert await _served_by(http, front.url + "/generative_scoring", {"model": "m", "query": "q"}) == "v"
    received = [a[2] for a in v.asked + s.asked if "audio" in a[1]]
    assert len(received) == 3
    for kind, raw in received:  # the form, its boundary and its bytes, as the client sent it
        boundary = kind.split("boundary=", 1)[1].strip('"').encode()
        assert raw.startswith(b"--" + boundary) and audio in raw
        assert b'name="model"' in raw and b"whisper" in raw


async def test_an_audio_form_is_bounded_by_the_upload_limit_not_the_body_limit() -> None:
    """A recording larger than the JSON bodies' bound (here 1 MiB) reaches the engine whole; one
    larger than the upload bound (2 MiB here; 32 MiB by default, above vLLM's 25 MB clip limit)
    is the client's 413 naming ``body``, and so is a JSON body above its own bound."""
    v = Engine("v", ("/v1/audio/transcriptions", "/generative_scoring"))
    mib = 1024 * 1024
    async with _fleet(v, max_body_bytes=mib, max_upload_bytes=2 * mib) as (front, http):
        for size, status in ((mib + mib // 2, 200), (2 * mib + 1, 413)):
            form = aiohttp.FormData()
            form.add_field("file", b"\x01" * size, filename="clip.wav", content_type="audio/wav")
            form.add_field("model", "whisper")
            async with http.post(front.url + "/v1/audio/transcriptions", data=form) as r:
                assert r.status == status, await r.text()
                if status == 413:
                    assert (await r.json())["error"]["param"] == "body"
        body = {"model": "m", "query": "q" * (mib + 1)}
        async with http.post(front.url + "/generative_scoring", json=body) as r:
            assert (r.status, (await r.json())["error"]["param"]) == (413, "body")
    (received,) = [a[2][1] for a in v.asked if "audio" in a[1]]
    assert len(received) > mib + mib // 2
