"""KvMeshMiddleware: KV-cache-aware routing as pure ASGI middleware.

Three deployments, one class:

* embedded in an engine's own server (``vllm serve ... --middleware kvmesh.router.KvMeshMiddleware``;
  vLLM passes no arguments, so configuration comes from ``KVMESH_*`` / ``KVMESH_CONFIG``): requests
  routed to this engine go straight to the wrapped app, the others to the chosen peer;
* around any ASGI / Starlette / FastAPI app (``app.add_middleware(KvMeshMiddleware, settings=...)``);
* standalone (``kvmesh router``): the same middleware over an app with no local engine.

``POST /v1/chat/completions`` and ``POST /v1/completions`` are routed: body read (size-limited),
``nvext`` and the override headers validated, prompt tokenized and hashed, KvRouter asked, then
the request is served by the wrapped app or forwarded to a registered worker (never to an address
taken from the request) with a hop header that makes the peer serve it locally. A connection
failure before the first response byte fails over to the next-best worker. ``GET /kvmesh/workers``
and ``GET/POST /busy_threshold`` are answered here; every other path and every non-HTTP scope
passes straight through.

Per-request state lives in one ``_RoutedRequest`` per call, never on the middleware.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import msgspec

from kvmesh.errors import ConfigError, KvMeshError, RequestError
from kvmesh.hashing import block_hashes
from kvmesh.router.asgi import admin
from kvmesh.router.asgi.json_io import read_body, send_error, send_json
from kvmesh.router.asgi.tap import ResponseTap
from kvmesh.router.core.config import RouterConfig
from kvmesh.router.core.kv_router import Decision, Queued, Rejected, RouteRequest, RouteResult
from kvmesh.router.mesh.runtime import Mesh
from kvmesh.router.mesh.settings import MeshSettings
from kvmesh.router.request.nvext import EMPTY, PREFILL_HEADER, WORKER_HEADER, Nvext, parse_nvext
from kvmesh.router.request.tokenizer import Tokenizer, prompt_token_ids
from kvmesh.router.upstream.forwarder import ConnectFailed, StreamBroken, UpstreamResponse, end_to_end_headers

ASGIApp = Any
Scope = dict[str, Any]
Message = dict[str, Any]

GENERATION_PATHS = frozenset(("/v1/chat/completions", "/v1/completions"))
HOP_HEADER = b"x-kvmesh-hop"
# The forwarding replica's request id: the peer counts the request under it, as replica sync does.
REQUEST_ID_HEADER = b"x-kvmesh-request-id"
WORKER_ID_HEADER = b"x-kvmesh-worker-id"
_WORKER_HEADER_B = WORKER_HEADER.encode()
_PREFILL_HEADER_B = PREFILL_HEADER.encode()
_QUEUE_TIMEOUT = 120.0
_decode = msgspec.json.decode
_encode = msgspec.json.encode
# kvmesh_requests_total children by (counter, endpoint, route, status): labels() costs more than inc().
_REQUEST_COUNTERS: dict[tuple[Any, str, str, int], Any] = {}


class KvMeshMiddleware:
    """Route OpenAI generation requests across the fleet; pass everything else through."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        settings: MeshSettings | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        self.app = app
        self.settings = settings if settings is not None else MeshSettings.load()
        self.mesh = Mesh(self.settings, local_app=app, tokenizer=tokenizer)

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        kind = scope["type"]
        if kind != "http":
            if kind == "lifespan":
                await self._lifespan(scope, receive, send)
            else:
                await self.app(scope, receive, send)
            return
        path = scope["path"]
        if path in GENERATION_PATHS and scope["method"] == "POST":
            await self.mesh.ensure_started()
            for name, value in scope["headers"]:
                if name == HOP_HEADER:
                    await _HopRequest(self.mesh, self.app, scope, receive, send, value).run()
                    return
            await _RoutedRequest(self.mesh, self.app, scope, receive, send).run()
        elif admin.handles(path, scope["method"]):
            await self.mesh.ensure_started()
            await self.mesh.wait_ready()
            await admin.handle(self.mesh, scope, receive, send)
        elif path == "/kvmesh/workers" or path == "/busy_threshold":
            await self.mesh.ensure_started()
            await _admin(self.mesh, scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _lifespan(self, scope: Scope, receive: Any, send: Any) -> None:
        mesh = self.mesh

        async def lifespan_send(message: Message) -> None:
            if message["type"] == "lifespan.startup.complete":
                await mesh.ensure_started()
            elif message["type"] == "lifespan.shutdown.complete":
                await mesh.stop()
            await send(message)

        await self.app(scope, receive, lifespan_send)


# ---------------------------------------------------------------------------- helpers
def _replace_body(scope: Scope, body: bytes) -> Scope:
    headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
    headers.append((b"content-length", str(len(body)).encode()))
    return {**scope, "headers": headers}


def _body_receive(body: bytes, receive: Any) -> Any:
    """A ``receive`` that yields ``body`` once, then the client's own messages (disconnect)."""
    delivered = False

    async def body_receive() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # type: ignore[no-any-return]

    return body_receive


def _prompt_tokens(tokenizer: Tokenizer, body: dict[str, Any], endpoint: str) -> list[int]:
    """The prompt's token ids. A body the tokenizer or its chat template cannot render (a template
    that raises on role order, a tool call of the wrong shape) is the client's 400, as the engine
    would answer it; a tokenizer that is not ready (ConfigError) stays a server error."""
    try:
        return prompt_token_ids(tokenizer, body, endpoint)
    except (RequestError, ConfigError):
        raise
    except Exception as e:
        field = "messages" if endpoint.endswith("chat/completions") else "prompt"
        raise RequestError(f"the prompt could not be tokenized: {e!r}", field=field) from None


def _check_worker_ids(mesh: Mesh, nv: Nvext, headers: dict[str, str] | None) -> None:
    """Every worker id the request names must be registered: 400 naming the field that carried it."""
    registry = mesh.registry
    for worker_id, header, key in (
        (nv.backend_instance_id, WORKER_HEADER, "nvext.backend_instance_id"),
        (nv.decode_worker_id, None, "nvext.decode_worker_id"),
        (nv.prefill_worker_id, PREFILL_HEADER, "nvext.prefill_worker_id"),
    ):
        if worker_id is not None and registry.get(worker_id) is None:
            field = header if header is not None and headers and header in headers else key
            raise RequestError(f"unknown worker id {worker_id!r}", field=field)


# ---------------------------------------------------------------------------- routed request
class _RoutedRequest:
    """One routed generation request: parse, route, serve or forward, feed back."""

    __slots__ = (
        "app",
        "body",
        "decision",
        "disconnected",
        "endpoint",
        "isl",
        "last_event",
        "mesh",
        "nvext",
        "out_events",
        "raw_body",
        "receive",
        "request_id",
        "routed_at",
        "scope",
        "send",
        "t0",
        "t_first",
        "tokens",
        "wall0",
        "worker_id",
    )

    def __init__(self, mesh: Mesh, app: ASGIApp, scope: Scope, receive: Any, send: Any) -> None:
        self.mesh = mesh
        self.app = app
        self.scope = scope
        self.receive = receive
        self.send = send
        self.t0 = time.perf_counter()
        self.wall0 = time.time()
        self.endpoint = scope["path"]
        self.request_id = ""
        self.nvext: Nvext = EMPTY
        self.body: dict[str, Any] = {}
        self.raw_body = b""
        self.tokens: list[int] = []
        self.decision: Decision | None = None
        self.worker_id = ""
        self.isl = 0
        self.routed_at = 0.0
        self.t_first = 0.0
        self.last_event = 0.0
        self.out_events = 0
        self.disconnected = False

    async def run(self) -> None:
        mesh = self.mesh
        try:
            raw = await read_body(self.scope, self.receive, mesh.settings.max_body_bytes)
            if raw is None:
                return
            self.raw_body = raw
            # Discovery first: parsing reads the fleet's block size and routable workers.
            if not mesh.registry.ready.is_set():
                await mesh.wait_ready()
            request = self._parse(raw)
            if mesh.local_app is not None and not mesh.registry.routable:
                # Peers not known yet (or all gone): this engine can always serve its own requests.
                await self._serve_local_untracked()
                return
            result = self._route(request)
            # The common case, a decision right away, skips the coroutine that waits in the queue.
            decision = result if isinstance(result, Decision) else await self._settle(result, request)
            if decision is None:
                return
            await self._dispatch(decision, request)
        except RequestError as e:
            self._count("rejected", e.status)
            await send_error(self.send, e.status, str(e), e.field)

    # ------------------------------------------------------------------ parse + route
    def _parse(self, raw: bytes) -> RouteRequest:
        try:
            body = _decode(raw)
        except msgspec.DecodeError as e:
            raise RequestError(f"request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise RequestError("request body must be a JSON object")
        self.body = body
        headers = None
        for name, value in self.scope["headers"]:
            if name in (_WORKER_HEADER_B, _PREFILL_HEADER_B):
                headers = headers or {}
                headers[name.decode()] = value.decode("latin-1")
        self.nvext = nv = parse_nvext(body, headers) if ("nvext" in body or headers) else EMPTY
        mesh = self.mesh
        pinned = nv.pinned_worker
        if pinned is not None:
            _check_worker_ids(mesh, nv, headers)
        self.request_id = mesh.next_request_id()
        metrics = mesh.metrics
        hashes: list[int] = []
        isl = 0
        lora = mesh.registry.lora_of(body.get("model")) if mesh.registry.adapters else None
        if mesh.kv_mode:
            t = time.perf_counter()
            self.tokens = tokens = _prompt_tokens(mesh.tokenizer, body, self.endpoint)
            t_hash = time.perf_counter()
            block_size = mesh.registry.block_size or 16
            hashes = block_hashes(tokens, block_size, lora)
            metrics.phase["tokenize"].observe(t_hash - t)
            metrics.phase["hashing"].observe(time.perf_counter() - t_hash)
            isl = len(tokens)
            metrics.isl.observe(isl)
        self.isl = isl
        hints = nv.hints
        session = nv.session
        return RouteRequest(
            request_id=self.request_id,
            local_hashes=hashes,
            isl_tokens=isl,
            arrival=time.monotonic(),
            backend_instance_id=pinned,
            priority=hints.priority,
            latency_sensitivity=hints.latency_sensitivity,
            osl=hints.osl,
            overlap_score_credit=hints.kv_overlap_score_credit,
            session_id=session.session_id if session else None,
            session_action=session.action if session else None,
            session_timeout=session.timeout if session else None,
            allowed_workers=mesh.registry.routable if lora is None else mesh.registry.adapters[lora],
            lora_name=lora,
        )

    def _route(self, request: RouteRequest) -> RouteResult:
        router = self.mesh.router
        t = time.perf_counter()
        result = router.route(request, time.monotonic())
        self.routed_at = done = time.perf_counter()
        self.mesh.metrics.observe_routing(done - t, router.last_find_matches, done - self.t0)
        return result

    async def _settle(self, result: RouteResult, request: RouteRequest) -> Decision | None:
        """Turn a route result into a decision: wait out the queue, refuse with a status."""
        if isinstance(result, Decision):
            return result
        if isinstance(result, Rejected):
            await self._reject(result)
            return None
        assert isinstance(result, Queued)
        mesh = self.mesh
        fut: asyncio.Future[Decision] = asyncio.get_running_loop().create_future()
        mesh.waiters[request.request_id] = fut
        mesh.pump(time.monotonic())  # capacity may have freed since route()
        gone = asyncio.ensure_future(self._wait_disconnect())
        try:
            done, _ = await asyncio.wait(
                (fut, gone), timeout=_QUEUE_TIMEOUT, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            gone.cancel()
        if fut in done and not fut.cancelled():
            return fut.result()
        mesh.waiters.pop(request.request_id, None)
        mesh.router.cancel(request.request_id, time.monotonic())
        if fut.done() and not fut.cancelled():  # released in the same instant: free it again
            mesh.router.cancel(request.request_id, time.monotonic())
        if gone in done:
            self._count("disconnected", 499)
            return None
        retry = mesh.config.busy_retry_after_secs
        await self._error(
            503, f"request waited {_QUEUE_TIMEOUT:.0f}s in the admission queue", retry_after=retry
        )
        return None

    async def _wait_disconnect(self) -> None:
        while (await self.receive())["type"] != "http.disconnect":
            pass
        self.disconnected = True

    async def _reject(self, rejected: Rejected) -> None:
        pinned = self.nvext.pinned_worker
        if (
            rejected.reason == "unknown_worker"
            and pinned is not None
            and self.mesh.registry.get(pinned) is not None
        ):
            # Registered (``_parse`` checked), just not routable now: the client may retry.
            await self._error(
                503,
                f"worker {pinned!r} is down or not yet discovered",
                retry_after=self.mesh.config.busy_retry_after_secs,
            )
            return
        status = {
            "busy": 503,
            "queue_full": 429,
            "unknown_worker": 400,
            "no_workers": 503,
            "no_target": 503,
        }.get(rejected.reason, 503)
        field = "nvext.backend_instance_id" if rejected.reason == "unknown_worker" else None
        retry = rejected.retry_after
        if retry is None and status != 400:
            retry = self.mesh.config.busy_retry_after_secs
        await self._error(status, rejected.message, field=field, retry_after=retry)

    async def _error(
        self, status: int, message: str, *, field: str | None = None, retry_after: float | None = None
    ) -> None:
        self._count("rejected", status)
        headers = []
        if retry_after is not None:
            headers.append((b"retry-after", str(max(1, round(retry_after))).encode()))
        await send_error(self.send, status, message, field, headers=headers)

    def _count(self, route: str, status: int) -> None:
        counter = self.mesh.metrics.requests
        key = (counter, self.endpoint, route, status)
        child = _REQUEST_COUNTERS.get(key)
        if child is None:
            child = counter.labels(self.endpoint, route, str(status))
            if len(_REQUEST_COUNTERS) < 4096:
                _REQUEST_COUNTERS[key] = child
        child.inc()

    # ------------------------------------------------------------------ dispatch
    def _engine_body(self, worker_id: str) -> bytes:
        """The body the engine sees: nvext stripped, the priority in the engine's polarity."""
        body = self.body
        priority = self.nvext.hints.priority
        if "nvext" not in body and priority is None:
            return self.raw_body
        out = {k: v for k, v in body.items() if k != "nvext"}
        if priority is not None:
            w = self.mesh.registry.get(worker_id)
            polarity = w.info.priority_polarity if w is not None and w.info is not None else "none"
            if polarity == "lower_first":
                out["priority"] = -priority
            elif polarity == "higher_first":
                out["priority"] = priority
        return _encode(out)

    async def _dispatch(self, decision: Decision, request: RouteRequest) -> None:
        mesh = self.mesh
        registry = mesh.registry
        tried: set[str] = set()
        while True:
            self.decision = decision
            self.worker_id = worker_id = decision.worker[0]
            self._before_dispatch(decision)
            if registry.is_local(worker_id):
                await self._serve_local()
                return
            worker = registry.get(worker_id)
            assert worker is not None
            try:
                opened = await self._open_while_client_waits(worker.url)
            except ConnectFailed as e:
                mesh.router.cancel(self.request_id, time.monotonic())
                mesh.metrics.failovers.inc()
                tried.add(worker_id)
                await registry.mark_down(worker_id, str(e))
                allowed = registry.routable - tried
                if request.backend_instance_id is not None or not allowed:
                    await self._error(
                        502 if tried else 503, f"no worker could serve the request: {e}", retry_after=1.0
                    )
                    return
                request.allowed_workers = allowed
                next_decision = await self._settle(self._route(request), request)
                if next_decision is None:
                    return
                decision = next_decision
                continue
            if opened is None:  # the client left before the worker answered
                self._count("disconnected", 499)
                self.end(False)
                return
            await self._relay(*opened)
            return

    def _before_dispatch(self, decision: Decision) -> None:
        mesh = self.mesh
        metrics = mesh.metrics
        if self.isl:
            metrics.kv_hit_rate.observe(min(1.0, decision.cached_tokens / self.isl))
        nv = self.nvext
        session = nv.session
        if session is not None and session.action == "open":
            mesh.spawn(
                mesh.registry.rpc(
                    decision.worker[0],
                    "/kvmesh/session_control",
                    {"action": "open_session", "session_id": session.session_id, "timeout": session.timeout},
                )
            )
        if nv.cache_ttl is not None and mesh.kv_mode:
            mesh.spawn(
                mesh.registry.rpc(
                    decision.worker[0],
                    "/kvmesh/pin_prefix",
                    {"token_ids": self.tokens, "ttl_seconds": nv.cache_ttl},
                )
            )

    async def _open_while_client_waits(self, url: str) -> tuple[UpstreamResponse, bytes | None] | None:
        """``_open``, abandoned when the client disconnects first (None): closing the upstream
        connection tells the worker to abort, so a long prefill does not run for nobody."""
        opening = asyncio.ensure_future(self._open(url))
        gone = asyncio.ensure_future(self._wait_disconnect())
        try:
            await asyncio.wait((opening, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if opening.done():
            return opening.result()
        opening.cancel()
        with contextlib.suppress(asyncio.CancelledError, KvMeshError):
            await opening
        return None

    async def _open(self, url: str) -> tuple[UpstreamResponse, bytes | None]:
        """Send upstream and wait for the first body bytes: until then a failure may fail over."""
        headers = end_to_end_headers(self.scope["headers"], REQUEST_ID_HEADER)
        headers.append((HOP_HEADER, self.mesh.replica.encode()))
        headers.append((REQUEST_ID_HEADER, self.request_id.encode()))
        path = self.endpoint
        if self.scope.get("query_string"):
            path += "?" + self.scope["query_string"].decode("latin-1")
        upstream = await self.mesh.forwarder.open(
            url, "POST", path, headers, self._engine_body(self.worker_id)
        )
        try:
            first = await upstream.chunks().__anext__()
        except StopAsyncIteration:
            return upstream, None
        except StreamBroken as e:
            upstream.close()
            raise ConnectFailed(url, f"failed before the first byte: {e}") from None
        except BaseException:  # cancelled: the client left
            upstream.close()
            raise
        return upstream, first

    async def _relay(self, upstream: UpstreamResponse, first: bytes | None) -> None:
        tap = ResponseTap(self.send, self, extra_headers=[(WORKER_ID_HEADER, self.worker_id.encode())])
        # A response that arrived whole (small JSON answers) goes out at once: a client leaving
        # now has nothing left to abort, so only a response still on the wire is watched.
        whole = upstream.drained
        watcher = None if whole else asyncio.get_running_loop().create_task(self._watch_client(upstream))
        try:
            await tap({"type": "http.response.start", "status": upstream.status, "headers": upstream.headers})
            if whole:
                await tap({"type": "http.response.body", "body": first or b"", "more_body": False})
            else:
                if first is not None:
                    await tap({"type": "http.response.body", "body": first, "more_body": True})
                    async for chunk in upstream.chunks():
                        await tap({"type": "http.response.body", "body": chunk, "more_body": True})
                await tap({"type": "http.response.body", "body": b"", "more_body": False})
            upstream.release()
            self._count("forwarded", upstream.status)
        except StreamBroken as e:
            upstream.close()
            if not self.disconnected:
                await self._broken(tap, str(e))
        finally:
            if watcher is not None:
                watcher.cancel()
            if not tap.complete:
                upstream.close()
                self.end(False)

    async def _watch_client(self, upstream: UpstreamResponse) -> None:
        await self._wait_disconnect()
        upstream.close()  # the worker sees the disconnect and can abort the generation

    async def _broken(self, tap: ResponseTap, message: str) -> None:
        """The worker broke off mid-response: end the client's response cleanly."""
        self._count("forwarded", 502)
        if not tap.started:
            await send_error(self.send, 502, message, kind="upstream_error")
            return
        event = (
            b"data: "
            + _encode({"error": {"message": message, "type": "upstream_error", "code": 502}})
            + b"\n\n"
        )
        with contextlib.suppress(Exception):
            await self.send({"type": "http.response.body", "body": event, "more_body": False})

    async def _serve_local(self) -> None:
        body = self._engine_body(self.worker_id)
        scope = self.scope if body is self.raw_body else _replace_body(self.scope, body)
        tap = ResponseTap(self.send, self, extra_headers=[(WORKER_ID_HEADER, self.worker_id.encode())])
        try:
            await self.app(scope, _body_receive(body, self.receive), tap)
        finally:
            self._count("local", tap.status)
            if not tap.complete:
                self.end(False)

    async def _serve_local_untracked(self) -> None:
        body = (
            _encode({k: v for k, v in self.body.items() if k != "nvext"})
            if "nvext" in self.body
            else self.raw_body
        )
        scope = self.scope if body is self.raw_body else _replace_body(self.scope, body)
        self._count("local", 0)
        await self.app(scope, _body_receive(body, self.receive), self.send)

    # ------------------------------------------------------------------ Observer (ResponseTap)
    def first_event(self) -> None:
        now = time.perf_counter()
        self.t_first = self.last_event = now
        self.mesh.router.first_token(self.request_id, time.monotonic())
        self.mesh.metrics.ttft.observe(now - self.t0)

    def events(self, n: int) -> None:
        now = time.perf_counter()
        if self.out_events:
            self.mesh.metrics.itl.observe(now - self.last_event)
        self.last_event = now
        self.out_events += n
        self.mesh.router.output_tokens(self.request_id, n, time.monotonic())

    def usage(self, usage: dict[str, Any]) -> None:
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        decision = self.decision
        if isinstance(cached, int) and decision is not None:
            self.mesh.record_cached(self.worker_id, decision.cached_tokens, cached)
            self.mesh.router.reported_cached(self.request_id, cached)

    def echo(self) -> dict[str, Any] | None:
        nv = self.nvext
        if not nv.wants_echo:
            return None
        out: dict[str, Any] = {}
        if nv.want_worker_id:
            out["worker_id"] = self.worker_id
        if nv.want_timing:
            now = time.perf_counter()
            out["timing"] = {
                "request_received_ms": round(self.wall0 * 1000, 3),
                "routing_ms": round((self.routed_at - self.t0) * 1000, 3),
                "ttft_ms": round((self.t_first - self.t0) * 1000, 3) if self.t_first else None,
                "total_ms": round((now - self.t0) * 1000, 3),
                "queue_ms": round(self.decision.waited * 1000, 3) if self.decision else 0.0,
                "cached_tokens_predicted": self.decision.cached_tokens if self.decision else 0,
            }
        return out

    def end(self, complete: bool) -> None:
        mesh = self.mesh
        now = time.monotonic()
        if complete:
            sample = mesh.router.finished(self.request_id, now)
            mesh.metrics.osl.observe(self.out_events)
            if sample is not None:
                mesh.record_ttft_prediction(sample)
        else:
            mesh.router.cancel(self.request_id, now)
        session = self.nvext.session
        if session is not None and session.action == "close" and self.worker_id:
            mesh.spawn(
                mesh.registry.rpc(
                    self.worker_id,
                    "/kvmesh/session_control",
                    {"action": "close_session", "session_id": session.session_id},
                )
            )
        mesh.pump(now)


# ---------------------------------------------------------------------------- hop (peer side)
class _HopRequest:
    """A request another replica already routed here: serve it locally, count it as our load."""

    __slots__ = ("app", "mesh", "origin", "receive", "request_id", "scope", "send")

    def __init__(
        self, mesh: Mesh, app: ASGIApp, scope: Scope, receive: Any, send: Any, origin: bytes
    ) -> None:
        self.mesh = mesh
        self.app = app
        self.scope = scope
        self.receive = receive
        self.send = send
        self.origin = origin
        self.request_id = ""

    async def run(self) -> None:
        mesh = self.mesh
        self_id = mesh.settings.self_worker_id
        if self_id is None or not mesh.kv_mode:
            await self.app(self.scope, self.receive, self.send)
            return
        try:
            raw = await read_body(self.scope, self.receive, mesh.settings.max_body_bytes)
        except RequestError as e:
            await send_error(self.send, e.status, str(e), e.field)
            return
        if raw is None:
            return
        tracked = False
        try:
            body = _decode(raw)
            tokens = prompt_token_ids(mesh.tokenizer, body, self.scope["path"])
            lora = mesh.registry.lora_of(body.get("model")) if mesh.registry.adapters else None
            hashes = block_hashes(tokens, mesh.registry.block_size or 16, lora)
            self.request_id = self._origin_request_id() or (
                f"hop-{self.origin.decode('latin-1')}-{mesh.next_request_id()}"
            )
            mesh.router.track(self.request_id, (self_id, 0), hashes, len(tokens), time.monotonic())
            tracked = True
        except (msgspec.DecodeError, KvMeshError, AttributeError, ValueError):
            pass  # the engine answers a bad body itself
        if not tracked:
            await self.app(self.scope, _body_receive(raw, self.receive), self.send)
            return
        tap = ResponseTap(self.send, self)
        try:
            await self.app(self.scope, _body_receive(raw, self.receive), tap)
        finally:
            if not tap.complete:
                self.end(False)

    def _origin_request_id(self) -> str | None:
        """The forwarding replica's id for this request: with replica sync, the same request
        arrives from that replica's decision stream too, and must count once."""
        for name, value in self.scope["headers"]:
            if name == REQUEST_ID_HEADER:
                return value.decode("latin-1") or None
        return None

    def first_event(self) -> None:
        self.mesh.router.first_token(self.request_id, time.monotonic())

    def events(self, n: int) -> None:
        self.mesh.router.output_tokens(self.request_id, n, time.monotonic())

    def usage(self, usage: dict[str, Any]) -> None:
        return None

    def echo(self) -> dict[str, Any] | None:
        return None

    def end(self, complete: bool) -> None:
        now = time.monotonic()
        if complete:
            self.mesh.router.finished(self.request_id, now)
        else:
            self.mesh.router.cancel(self.request_id, now)
        self.mesh.pump(now)


# ---------------------------------------------------------------------------- admin endpoints
_THRESHOLD_FIELDS = (
    "active_decode_blocks_threshold",
    "active_prefill_tokens_threshold",
    "active_prefill_tokens_threshold_frac",
)


async def _admin(mesh: Mesh, scope: Scope, receive: Any, send: Any) -> None:
    path = scope["path"]
    method = scope["method"]
    if path == "/kvmesh/workers" and method == "GET":
        await mesh.wait_ready()
        registry = mesh.registry
        doc = {
            "replica": mesh.replica,
            "router_mode": mesh.config.router_mode,
            "block_size": registry.block_size,
            "workers": registry.snapshot(),
        }
        await send_json(send, 200, _encode(doc))
        return
    if path == "/busy_threshold" and method == "GET":
        await send_json(send, 200, _encode(_thresholds(mesh)))
        return
    if path == "/busy_threshold" and method == "POST":
        if not admin.authorized(mesh.settings.admin_token, scope["headers"]):
            await send_error(send, 401, "admin token missing or wrong", kind="unauthorized")
            return
        try:
            raw = await read_body(scope, receive, 64 * 1024)
            if raw is None:
                return
            changes = _parse_thresholds(raw)
            mesh.router.set_busy_thresholds(**changes)
        except RequestError as e:
            await send_error(send, e.status, str(e), e.field)
            return
        await send_json(send, 200, _encode(_thresholds(mesh)))
        return
    await send_error(send, 405, f"{method} not allowed on {path}", headers=[(b"allow", b"GET, POST")])


def _thresholds(mesh: Mesh) -> dict[str, Any]:
    t = mesh.router.busy_thresholds()
    return {name: getattr(t, name) for name in _THRESHOLD_FIELDS}


def _parse_thresholds(raw: bytes) -> dict[str, Any]:
    try:
        doc = _decode(raw)
    except msgspec.DecodeError:
        raise RequestError("body must be a JSON object") from None
    if not isinstance(doc, dict) or not doc:
        raise RequestError(f"body must be a JSON object with some of: {', '.join(_THRESHOLD_FIELDS)}")
    changes: dict[str, Any] = {}
    for key, value in doc.items():
        if key not in _THRESHOLD_FIELDS:
            raise RequestError(f"unknown threshold {key!r}", field=key)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0
        ):
            raise RequestError(f"{key} must be a non-negative number or null", field=key)
        if key == "active_prefill_tokens_threshold" and value is not None:
            value = int(value)
        changes[key] = value
    try:  # the flags' own ranges, with messages naming the flag
        RouterConfig().with_overrides(**changes)
    except ConfigError as e:
        raise RequestError(str(e), field=next(iter(changes))) from None
    return changes


__all__ = ["KvMeshMiddleware"]
