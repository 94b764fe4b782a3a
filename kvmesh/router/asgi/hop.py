"""The peer side of a forwarded request: another replica routed it here, so serve it locally and
count it as this engine's load (under the forwarding replica's request id, so that replica sync
counts it once)."""

from __future__ import annotations

import time
from typing import Any

import msgspec

from kvmesh._http import replay_body
from kvmesh.errors import KvMeshError, RequestError
from kvmesh.hashing import block_hashes
from kvmesh.router.asgi.accounting import LoadAccount
from kvmesh.router.asgi.forwarding import REQUEST_ID_HEADER
from kvmesh.router.asgi.json_io import read_body, send_error
from kvmesh.router.asgi.tap import ResponseTap
from kvmesh.router.mesh.runtime import Mesh
from kvmesh.router.request.tokenizer import prompt_token_ids

ASGIApp = Any
Scope = dict[str, Any]


class HopRequest:
    """A request another replica already routed here (one instance per call)."""

    __slots__ = ("app", "mesh", "origin", "receive", "scope", "send")

    def __init__(
        self, mesh: Mesh, app: ASGIApp, scope: Scope, receive: Any, send: Any, origin: bytes
    ) -> None:
        self.mesh = mesh
        self.app = app
        self.scope = scope
        self.receive = receive
        self.send = send
        self.origin = origin

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
        account: LoadAccount | None = None
        try:
            body = msgspec.json.decode(raw)
            tokens = prompt_token_ids(mesh.tokenizer, body, self.scope["path"])
            lora = mesh.registry.lora_of(body.get("model")) if mesh.registry.adapters else None
            hashes = block_hashes(tokens, mesh.registry.block_size or 16, lora)
            request_id = self._origin_request_id() or (
                f"hop-{self.origin.decode('latin-1')}-{mesh.next_request_id()}"
            )
            mesh.router.track(request_id, (self_id, 0), hashes, len(tokens), time.monotonic())
            account = LoadAccount(mesh, request_id)
        except (msgspec.DecodeError, KvMeshError, AttributeError, ValueError):
            pass  # the engine answers a bad body itself
        receive = replay_body(raw, self.receive)
        if account is None:
            await self.app(self.scope, receive, self.send)
            return
        tap = ResponseTap(self.send, account)
        try:
            await self.app(self.scope, receive, tap)
        finally:
            if not tap.complete:
                account.end(False)

    def _origin_request_id(self) -> str | None:
        """The forwarding replica's id for this request: with replica sync, the same request
        arrives from that replica's decision stream too, and must count once."""
        for name, value in self.scope["headers"]:
            if name == REQUEST_ID_HEADER:
                return value.decode("latin-1") or None
        return None
