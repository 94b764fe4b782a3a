"""KvMeshMiddleware: KV-cache-aware routing as pure ASGI middleware.

Three deployments, one class:

* embedded in an engine's own server (``vllm serve ... --middleware kvmesh.adapters.vllm.KvMeshMiddleware``,
  the engine-aware subclass; vLLM passes no arguments, so configuration comes from ``KVMESH_*`` / ``KVMESH_CONFIG``): requests
  routed to this engine go straight to the wrapped app, the others to the chosen peer;
* around any ASGI / Starlette / FastAPI app (``app.add_middleware(KvMeshMiddleware, settings=...)``);
* standalone (``kvmesh router``): the same middleware over an app with no local engine.

``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/responses`` and Anthropic's
``POST /v1/messages`` are routed
(:class:`~kvmesh.router.asgi.routed.RoutedRequest`): body read (size-limited), ``nvext`` and the
override headers validated, prompt tokenized and hashed, KvRouter asked, then the request is served
by the wrapped app or forwarded to a registered worker (never to an address taken from the request)
with a hop header that makes the peer serve it locally (:class:`~kvmesh.router.asgi.hop.HopRequest`).
A stored response asked for again (``/v1/responses/{id}``) goes to the engine that stored it
(:mod:`kvmesh.router.asgi.stored_responses`). In front of SGLang, and standalone, SGLang's native
``/generate`` (POST or PUT) is routed too (``generation_paths``; any other app may have a
``/generate`` of its own, in another shape), and its ``/abort_request`` goes where the requests
run (:mod:`kvmesh.router.asgi.aborts`), as does vLLM's token API's abort in front of vLLM, whose
batch of conversations (``/v1/chat/completions/batch``) is routed conversation by conversation.
In front of either engine, and standalone, SageMaker's ``/invocations`` is routed as the chat
request or completion its body is (:mod:`kvmesh.router.asgi.invocations`); in front of SGLang, and
standalone, so are Ollama's ``/api/chat`` and ``/api/generate``
(:mod:`kvmesh.router.request.ollama_api`) and Vertex AI's prediction route, instance by instance
(:mod:`kvmesh.router.request.vertex_api`), each on the path SGLang's variables put it. The
admin endpoints (:mod:`kvmesh.router.asgi.admin`) are answered here. A scrape of an engine's
multiprocess ``/metrics`` gets kvmesh's live gauges added (:mod:`kvmesh.router.asgi.scrape`). Every
other path and every non-HTTP scope passes straight through.

Per-request state lives in one object per call, never on the middleware (Starlette's rule).
"""

from __future__ import annotations

import os
from typing import Any

from kvmesh._http import replay_body, route_path
from kvmesh.errors import RequestError
from kvmesh.router.asgi import (
    aborts,
    admin,
    invocations,
    peer_auth,
    scrape,
    sglang_sessions,
    stored_responses,
)
from kvmesh.router.asgi.hop import HopRequest
from kvmesh.router.asgi.json_io import read_body, send_error
from kvmesh.router.asgi.routed import RoutedRequest
from kvmesh.router.mesh.registry import PAUSE_CALLS
from kvmesh.router.mesh.runtime import Mesh
from kvmesh.router.mesh.settings import MeshSettings
from kvmesh.router.request.batches import CHAT_BATCH_PATH
from kvmesh.router.request.generate_api import GENERATE_PATH
from kvmesh.router.request.invocations import INVOCATIONS_PATH, invoked_endpoint
from kvmesh.router.request.messages_api import MESSAGES_PATH
from kvmesh.router.request.ollama_api import OLLAMA_PATHS, moved_routes
from kvmesh.router.request.parse import decode_body
from kvmesh.router.request.responses_api import RESPONSES_PATH
from kvmesh.router.request.tokenizer import Tokenizer
from kvmesh.router.request.tokens_api import TOKENS_PATH
from kvmesh.router.request.vertex_api import VERTEX_PATH, vertex_route

ASGIApp = Any
Scope = dict[str, Any]
Message = dict[str, Any]

GENERATION_PATHS = frozenset(("/v1/chat/completions", "/v1/completions", RESPONSES_PATH, MESSAGES_PATH))
WITH_GENERATE = GENERATION_PATHS | {GENERATE_PATH, INVOCATIONS_PATH} | OLLAMA_PATHS
"""The generation paths where the server behind is SGLang's (the aborts of its requests are then
sent where they run: :mod:`.aborts`; SageMaker's entry point, :mod:`.invocations`; and Ollama's
chat and generate, :mod:`~kvmesh.router.request.ollama_api`)."""
WITH_TOKENS = GENERATION_PATHS | {TOKENS_PATH, CHAT_BATCH_PATH, INVOCATIONS_PATH}
"""The generation paths where the server behind is vLLM's (its token-in-token-out API, whose
aborts are then sent where the requests run: :mod:`.aborts`; its batch of conversations; and
SageMaker's entry point, :mod:`.invocations`)."""
EVERY_PATH = WITH_GENERATE | WITH_TOKENS
"""Where the servers behind may be either (the standalone router, a simulated fleet)."""


def routes(paths: frozenset[str], path: str, method: str) -> bool:
    """Whether a request is one to route: a POST to one of ``paths``, or a PUT to SGLang's
    ``/generate``, which takes both."""
    return path in paths and (method == "POST" or (method == "PUT" and path == GENERATE_PATH))


class KvMeshMiddleware:
    """Route OpenAI generation requests across the fleet; pass everything else through."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        settings: MeshSettings | None = None,
        tokenizer: Tokenizer | None = None,
        generation_paths: frozenset[str] = GENERATION_PATHS,
    ) -> None:
        self.app = app
        self.endpoints: dict[str, str] = {}
        """The paths SGLang serves an endpoint on by its variables, and that endpoint: Vertex AI's
        (``AIP_PREDICT_ROUTE``) and Ollama's moved ones, routed where ``/generate`` is."""
        if GENERATE_PATH in generation_paths:
            moved = {vertex_route(os.environ): VERTEX_PATH}
            moved.update((p, e) for p, e in moved_routes(os.environ).items() if e in OLLAMA_PATHS)
            for path, endpoint in moved.items():
                if path not in generation_paths:  # (SGLang's own route there comes first)
                    self.endpoints[path] = endpoint
            gone = {endpoint for endpoint in self.endpoints.values() if endpoint in OLLAMA_PATHS}
            generation_paths = (generation_paths - gone) | frozenset(self.endpoints)
        self.generation_paths = generation_paths
        self.settings = settings if settings is not None else MeshSettings.load()
        self.mesh = Mesh(self.settings, local_app=app, tokenizer=tokenizer)
        self.admin = admin.build_admin_app(self.mesh)
        self.sessions = GENERATE_PATH in generation_paths and self.mesh.local_app is not None
        """Inside an SGLang engine: its sessions' paths are this router's too (:mod:`.sglang_sessions`)."""

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if self.mesh.rpc.framework is None and "app" in scope:
            # (the server's framework app, for the requests the router makes to its engine itself)
            self.mesh.rpc.framework = scope["app"]
        kind = scope["type"]
        if kind != "http":
            if kind == "lifespan":
                await self._lifespan(scope, receive, send)
            else:
                await self.app(scope, receive, send)
            return
        path = route_path(scope)
        if routes(self.generation_paths, path, scope["method"]):
            await self.mesh.ensure_started()
            if path == INVOCATIONS_PATH:
                await self._invocation(scope, receive, send)
                return
            await self._generation(scope, receive, send, self.endpoints.get(path, path))
        elif (api := aborts.abort_api(path, scope["method"], self.generation_paths)) is not None:
            await aborts.serve(self.mesh, api, self.app, scope, receive, send)
        elif self.sessions and sglang_sessions.handles_embedded(path):
            await self.mesh.ensure_started()
            await sglang_sessions.serve_embedded(self.mesh, self.app, scope, receive, send)
        elif stored_responses.handles(path):
            await stored_responses.serve(self.mesh, self.app, scope, receive, send)
        elif admin.handles(path):
            await self.admin(scope, receive, send)
        elif scrape.merges(scope):
            await scrape.serve_with_gauges(self.app, scope, receive, send, self.mesh.metrics)
        elif path in PAUSE_CALLS and scope["method"] == "POST":
            await self.app(scope, receive, self._reading_pauses(send))
        else:
            await self.app(scope, receive, send)

    def _reading_pauses(self, send: Any) -> Any:
        """``send``, asking the engines a pause or a resume reached whether they are paused before
        its answer ends (this engine, inside one; every worker, through the standalone router's
        fleet control). Left to the next health check, up to an interval later, requests went to
        the engine just paused, which held them, or passed over one just resumed; and the client
        that paused it could not tell when the router knew."""
        mesh = self.mesh
        self_id = self.settings.self_worker_id
        local = [self_id] if mesh.local_app is not None and self_id is not None else None
        status = 0

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif (
                message["type"] == "http.response.body"
                and not message.get("more_body", False)
                and 200 <= status < 300  # (a refused call reached no engine, or changed nothing)
            ):
                reached = local if local is not None else list(mesh.registry.workers)
                await mesh.registry.read_pauses_now(reached)
            await send(message)

        return sending

    async def _generation(self, scope: Scope, receive: Any, send: Any, endpoint: str) -> None:
        """Route a generation request served as ``endpoint``, or serve a peer's hop here."""
        headers = scope["headers"]
        if peer_auth.has_internal(headers):
            # Judge the hop headers once, then drop them: no copy travels further (peer_auth).
            hop = peer_auth.read_hop(headers, self.settings.mesh_secret)
            scope = {**scope, "headers": peer_auth.strip_internal(headers)}
            if hop is not None and self.mesh.local_app is not None:
                await HopRequest(self.mesh, self.app, scope, receive, send, hop, endpoint).run()
                return
        await RoutedRequest(self.mesh, self.app, scope, receive, send, endpoint).run()

    async def _invocation(self, scope: Scope, receive: Any, send: Any) -> None:
        """SageMaker's entry point: routed as the generation its body is, or passed on
        (:mod:`kvmesh.router.asgi.invocations`)."""
        settings = self.settings
        try:
            raw = await read_body(scope, receive, settings.max_body_bytes, settings.body_read_timeout)
            endpoint = invoked_endpoint(decode_body(raw)) if raw is not None else None
        except RequestError as e:
            await send_error(send, e.status, str(e), e.field)
            return
        if raw is None:
            return  # the client left
        receive = replay_body(raw, receive)
        if endpoint is not None:
            await self._generation(scope, receive, send, endpoint)
        else:  # (not a generation: the engine's, or the standalone router's relay)
            await self.app(scope, receive, invocations.learning_sessions(self.mesh, send))

    async def _lifespan(self, scope: Scope, receive: Any, send: Any) -> None:
        mesh = self.mesh

        async def lifespan_send(message: Message) -> None:
            if message["type"] == "lifespan.startup.complete":
                await mesh.ensure_started()
            elif message["type"] == "lifespan.shutdown.complete":
                await mesh.stop()
            await send(message)

        await self.app(scope, receive, lifespan_send)


__all__ = ["KvMeshMiddleware"]
