"""The peer side of a forwarded request: another replica routed it here, so serve it locally and
count it as this engine's load (under the forwarding replica's request id when the hop is proven,
so that replica sync counts it once; see :mod:`~kvmesh.router.asgi.peer_auth`).

The body is parsed like any client's: a hop that cannot be proven may come from a client, so
``nvext`` is validated (400 naming the field) and stripped before the engine sees it, and a body
the router would refuse (malformed, nested too deep) is refused here too.
"""

from __future__ import annotations

import time
from typing import Any

from kvmesh._http import replay_body, route_path
from kvmesh.errors import ConfigError, RequestError
from kvmesh.router.asgi.accounting import LoadAccount
from kvmesh.router.asgi.forwarding import replace_body
from kvmesh.router.asgi.invocations import lora_reading
from kvmesh.router.asgi.json_io import read_body, send_error
from kvmesh.router.asgi.peer_auth import Hop
from kvmesh.router.asgi.tap import ResponseTap
from kvmesh.router.mesh.runtime import Mesh
from kvmesh.router.request.batches import PromptBatch
from kvmesh.router.request.parse import ParsedRequest, parse_request

ASGIApp = Any
Scope = dict[str, Any]


class HopRequest:
    """A request another replica already routed here (one instance per call)."""

    __slots__ = ("app", "endpoint", "hop", "mesh", "receive", "scope", "send")

    def __init__(
        self,
        mesh: Mesh,
        app: ASGIApp,
        scope: Scope,
        receive: Any,
        send: Any,
        hop: Hop,
        endpoint: str | None = None,
    ) -> None:
        self.endpoint = endpoint or route_path(scope)  # (SageMaker's /invocations: what its body is)
        self.mesh = mesh
        self.app = app
        self.scope = scope
        self.receive = receive
        self.send = send
        self.hop = hop

    async def run(self) -> None:
        mesh = self.mesh
        settings = mesh.settings
        self_id = settings.self_worker_id
        track = self_id is not None and mesh.kv_mode
        try:
            raw = await read_body(
                self.scope, self.receive, settings.max_body_bytes, settings.body_read_timeout
            )
        except RequestError as e:
            await send_error(self.send, e.status, str(e), e.field)
            return
        if raw is None:
            return
        registry = mesh.registry
        try:
            parsed: ParsedRequest | None = parse_request(
                raw,
                self.scope["headers"],
                self.endpoint,
                tokenizer=mesh.tokenizer if track else None,
                block_size=registry.block_size or 16,
                lora_of=lora_reading(registry, route_path(self.scope), self.scope["headers"]),
                clock=time.perf_counter,
                limits=mesh.nvext_limits,
            )
        except (ConfigError, PromptBatch):
            # The tokenizer is not ready, or a peer sent a whole batch (each prompt of a batch
            # travels on its own): serve the hop untracked.
            parsed = None
        except RequestError as e:
            await send_error(self.send, e.status, str(e), e.field)
            return
        if parsed is None:
            await self.app(self.scope, replay_body(raw, self.receive), self.send)
            return
        body = parsed.engine_body(self._polarity())
        scope = self.scope if body is raw else replace_body(self.scope, body)
        receive = replay_body(body, self.receive)
        if not track:
            await self.app(scope, receive, self.send)
            return
        assert self_id is not None
        request_id = self.hop.request_id or f"hop-{self.hop.origin}-{mesh.next_request_id()}"
        mesh.router.track(request_id, (self_id, 0), parsed.hashes, parsed.isl, time.monotonic())
        account = LoadAccount(mesh, request_id)
        tap = ResponseTap(self.send, account)
        try:
            await self.app(scope, receive, tap)
        finally:
            if not tap.complete:
                account.end(False)

    def _polarity(self) -> str:
        worker = self.mesh.registry.get(self.mesh.settings.self_worker_id or "")
        return worker.info.priority_polarity if worker is not None and worker.info is not None else "none"


__all__ = ["HopRequest"]
