"""Disaggregated serving: prefill on one pool, decode on another, the KV cache handed between them
in the engines' own protocol.

With any prefill worker up, a routed request goes in two stages:

1. **prefill**, KV-aware among the prefill workers (overlap against prefill load; the request
   counts on the prefill worker only until its prefill answer, so no decode blocks are held there);
2. **decode**, among the decode (and aggregated) workers, load-aware and KV-aware where decode
   workers cache prefixes, streamed to the client exactly as an aggregated request would be.

The hand-off follows the prefill worker's backend:

* ``vllm`` (and kvmesh's simulated engine, which speaks the same protocol): the prefill request
  carries ``kv_transfer_params = {"do_remote_decode": true, ...}`` with ``max_tokens: 1`` and no
  streaming; its JSON answer returns ``kv_transfer_params`` (where the KV sits), which the decode
  request carries back, as vLLM's NIXL / Mooncake connectors expect. Sequential.
* ``sglang``: both requests carry ``bootstrap_host`` (the prefill worker's host),
  ``bootstrap_port`` (its ``--disaggregation-bootstrap-port``) and a random ``bootstrap_room``;
  they are sent together and the engines meet at the bootstrap server.

``nvext.prefill_worker_id`` / ``x-prefill-instance-id`` pin the prefill stage,
``nvext.decode_worker_id`` / ``backend_instance_id`` / ``x-worker-instance-id`` the decode stage.
A prefill stage that fails (no answer, an error status, no transfer parameters) is not the
client's problem: the request is served aggregated on the decode worker instead, logged and
counted (``kvmesh_disagg_stage_total{stage="prefill",outcome="fallback"}``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from typing import Any, Protocol
from urllib.parse import urlsplit

import msgspec

from kvmesh.errors import KvMeshError
from kvmesh.router.asgi.accounting import RoutedAccount
from kvmesh.router.asgi.forwarding import session_header
from kvmesh.router.asgi.peer_auth import hop_headers, strip_internal
from kvmesh.router.core.route_types import Decision, RouteRequest, RouteResult
from kvmesh.router.mesh.registry import Worker
from kvmesh.router.mesh.runtime import Mesh
from kvmesh.router.mesh.worker_rpc import call_app
from kvmesh.router.request.parse import ParsedRequest
from kvmesh.router.upstream.forwarder import ConnectFailed, StreamBroken, end_to_end_headers

logger = logging.getLogger("kvmesh.router")

# Which hand-off a prefill worker's backend speaks.
TRANSFER_PARAMS, BOOTSTRAP = "kv_transfer_params", "bootstrap"
_PROTOCOL = {"vllm": TRANSFER_PARAMS, "mock": TRANSFER_PARAMS, "sglang": BOOTSTRAP}
SGLANG_DEFAULT_BOOTSTRAP_PORT = 8998
# The prefill request's half of vLLM's protocol: "compute the prompt's KV here, a remote engine
# decodes"; the remote_* fields are filled in by the prefill engine's answer.
_PREFILL_TRANSFER = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
_encode = msgspec.json.encode
_decode = msgspec.json.decode


def protocol_of(worker: Worker) -> str | None:
    return _PROTOCOL.get(worker.info.backend) if worker.info is not None else None


class Router(Protocol):
    """What a stage needs from the routed request that owns it (asgi/routed.RoutedRequest)."""

    mesh: Mesh
    scope: dict[str, Any]

    def route(self, request: RouteRequest, account: RoutedAccount) -> RouteResult: ...

    async def settle(
        self, result: RouteResult, request: RouteRequest, account: RoutedAccount
    ) -> Decision | None: ...

    async def dispatch(
        self, decision: Decision, parsed: ParsedRequest, account: RoutedAccount, request: RouteRequest
    ) -> None: ...


class PrefillFailed(KvMeshError):
    """The prefill stage gave no usable answer; the request falls back to aggregated serving."""


class TwoStage:
    """Route and serve one request in two stages (one instance per request)."""

    __slots__ = ("account", "parsed", "request", "routed")

    def __init__(
        self, routed: Router, parsed: ParsedRequest, account: RoutedAccount, request: RouteRequest
    ) -> None:
        self.routed = routed
        self.parsed = parsed
        self.account = account
        self.request = request

    async def run(self) -> None:
        routed = self.routed
        mesh = routed.mesh
        registry = mesh.registry
        nv = self.parsed.nvext
        metrics = mesh.metrics
        # The decode stage never takes the prefill pin.
        self.request.backend_instance_id = nv.backend_instance_id or nv.decode_worker_id
        prefill_request = dataclasses.replace(
            self.request,
            request_id=self.account.request_id + "-prefill",
            allowed_workers=registry.prefill_routable,
            backend_instance_id=nv.prefill_worker_id,
            session_id=None,
            session_action=None,
            session_timeout=None,
            osl=1,
        )
        prefill = await routed.settle(
            routed.route(prefill_request, self.account), prefill_request, self.account
        )
        if prefill is None:
            return  # answered (refused, or the client left)
        worker = registry.get(prefill.worker[0])
        protocol = protocol_of(worker) if worker is not None else None
        decode_parsed: ParsedRequest | None = None
        background: asyncio.Task[None] | None = None
        try:
            if worker is None or protocol is None:
                raise PrefillFailed(
                    f"prefill worker {prefill.worker[0]!r} speaks no known hand-off protocol "
                    f"(backend {worker.info.backend if worker and worker.info else None!r})"
                )
            if protocol == TRANSFER_PARAMS:
                decode_parsed = await self._prefill_then_params(worker, prefill)
            else:
                decode_parsed, background = self._bootstrap(worker, prefill)
            self.account.prefill_worker = prefill.worker
            self.request.prefilled_elsewhere = True
        except PrefillFailed as e:
            mesh.router.cancel(prefill_request.request_id, time.monotonic())
            metrics.disagg_stages.labels("prefill", "fallback").inc()
            logger.warning(
                "request %s: prefill stage failed (%s); serving it aggregated", prefill_request.request_id, e
            )
            decode_parsed = None
        decode = await routed.settle(routed.route(self.request, self.account), self.request, self.account)
        if decode is None:
            if background is not None:
                background.cancel()
            return
        metrics.disagg_stages.labels("decode", "ok").inc()
        await routed.dispatch(decode, decode_parsed or self.parsed, self.account, self.request)

    # ---------------------------------------------------------------- vLLM-style hand-off
    async def _prefill_then_params(self, worker: Worker, prefill: Decision) -> ParsedRequest:
        """Prefill with ``max_tokens: 1``; the decode request carries back its transfer params."""
        mesh = self.routed.mesh
        body = self._engine_doc(worker)
        for key in ("stream", "stream_options"):
            body.pop(key, None)
        body["max_tokens"] = 1
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = 1
        body["kv_transfer_params"] = dict(_PREFILL_TRANSFER)
        t0 = time.perf_counter()
        try:
            status, answer = await self._call(worker, prefill.request_id, _encode(body))
        finally:
            mesh.router.finished(prefill.request_id, time.monotonic())
        mesh.metrics.disagg_prefill_seconds.observe(time.perf_counter() - t0)
        if status != 200:
            raise PrefillFailed(f"HTTP {status}: {answer[:200]!r}")
        try:
            doc = _decode(answer)
        except msgspec.DecodeError:
            raise PrefillFailed("the prefill answer is not JSON") from None
        params = doc.get("kv_transfer_params") if isinstance(doc, dict) else None
        if not isinstance(params, dict):
            raise PrefillFailed("the prefill answer carries no kv_transfer_params (is a KV connector set?)")
        mesh.metrics.disagg_stages.labels("prefill", "ok").inc()
        return self._with_fields(worker, {"kv_transfer_params": params})

    # ---------------------------------------------------------------- SGLang-style hand-off
    def _bootstrap(self, worker: Worker, prefill: Decision) -> tuple[ParsedRequest, asyncio.Task[None]]:
        """Both requests name the prefill worker's bootstrap server and one room; prefill runs
        beside decode, and its answer only frees its load."""
        host = urlsplit(worker.url).hostname or "127.0.0.1"
        port = worker.info.bootstrap_port if worker.info and worker.info.bootstrap_port else None
        fields = {
            "bootstrap_host": host,
            "bootstrap_port": port or SGLANG_DEFAULT_BOOTSTRAP_PORT,
            "bootstrap_room": secrets.randbits(63),
        }
        body = self._engine_doc(worker)
        body.update(fields)
        task = self.routed.mesh.spawn(self._prefill_beside(worker, prefill, _encode(body)))
        return self._with_fields(worker, fields), task

    async def _prefill_beside(self, worker: Worker, prefill: Decision, body: bytes) -> None:
        mesh = self.routed.mesh
        t0 = time.perf_counter()
        try:
            status, _ = await self._call(worker, prefill.request_id, body)
            outcome = "ok" if status == 200 else "failed"
        except PrefillFailed:
            outcome = "failed"
        finally:
            mesh.router.finished(prefill.request_id, time.monotonic())
        mesh.metrics.disagg_prefill_seconds.observe(time.perf_counter() - t0)
        mesh.metrics.disagg_stages.labels("prefill", outcome).inc()

    # ---------------------------------------------------------------- helpers
    def _engine_doc(self, worker: Worker) -> dict[str, Any]:
        info = worker.info
        polarity = info.priority_polarity if info is not None else "none"
        doc = _decode(self.parsed.engine_body(polarity, info.backend if info is not None else ""))
        assert isinstance(doc, dict)
        return doc

    def _with_fields(self, worker: Worker, fields: dict[str, Any]) -> ParsedRequest:
        """The client's request for the decode stage, with the hand-off fields added."""
        body = {**self.parsed.body, **fields}
        return dataclasses.replace(self.parsed, body=body, raw_body=_encode(body))

    async def _call(self, worker: Worker, request_id: str, body: bytes) -> tuple[int, bytes]:
        """The whole prefill request: in-process for this engine, else over kvmesh's client with the
        hop header, so a peer embedding the middleware serves it itself and counts it."""
        routed = self.routed
        mesh = routed.mesh
        path = self.parsed.endpoint
        headers = strip_internal(end_to_end_headers(routed.scope["headers"]))
        headers = [(k, v) for k, v in headers if k not in (b"content-length", b"host")]
        tag = session_header(self.parsed, headers)  # the prefill stage is the session's turn too
        if tag is not None:
            headers.append(tag)
        # proven with the mesh secret when one is set: a peer trusts only a replica's hop
        headers += hop_headers(mesh.settings.mesh_secret, mesh.replica, request_id)
        if mesh.registry.is_local(worker.worker_id) and mesh.local_app is not None:
            try:
                return await call_app(
                    mesh.local_app, "POST", path, headers, body, framework=mesh.rpc.framework
                )
            except Exception as e:
                raise PrefillFailed(f"the local engine raised {e!r}") from None
        try:
            upstream = await mesh.forwarder.open(worker.url, "POST", path, headers, body)
        except ConnectFailed as e:
            await mesh.registry.mark_down(worker.worker_id, str(e))
            raise PrefillFailed(str(e)) from None
        except KvMeshError as e:
            raise PrefillFailed(str(e)) from None
        chunks = []
        try:
            async for chunk in upstream.chunks():
                chunks.append(chunk)
        except StreamBroken as e:
            upstream.close()
            raise PrefillFailed(f"the prefill answer broke off: {e}") from None
        except BaseException:
            upstream.close()
            raise
        upstream.release()
        return upstream.status, b"".join(chunks)
