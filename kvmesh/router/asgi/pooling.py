"""The standalone router's answer to the engines' pooling requests: embeddings, classification,
scores and reranking (vLLM 0.33's ``/v1/embeddings``, ``/v2/embed``, ``/pooling``, ``/classify``,
``/score``, ``/v1/score``, ``/rerank``, ``/v1/rerank``, ``/v2/rerank``; SGLang 0.5.23's
``/v1/embeddings``, ``/encode``, ``/classify``, ``/v1/classify``, ``/v1/rerank``, and its
``/v1/score`` and ``/v1/decisions``, which score label tokens on a generating model).

A fleet serving an embedding or reranking model behind the router had only a 404 for them. They
are relayed, not routed on a prefix: their inputs are short and seldom shared, and each engine
answers a batch of inputs in one request, so a prefix would be one input's among many. Each goes
to the routable worker with the least pooling work outstanding: the bytes of the bodies this relay
has sent there and not seen answered, which stand for their tokens (a batch of documents weighs
what its documents do, a query little). Ties are taken in turn. A router told ``--router-mode
round-robin`` or ``random`` takes the workers in turn or at random, as it does its generation
requests.

Not counted: the router's generation requests (an engine serves a pooling model or a generating
one; SGLang's label scores, which run beside generation, are weighed as the rest all the same),
and the requests the engine's ``/metrics`` reports. Those count the relay's own requests
too, and arrive a health check late; weighed in, they sent every query for a while to the engine
that looked idle at the last check (``benchmarks/pooling.py``: a query's p99 1.9x sglang-router's).

Bodies go through unchanged, the client's ``authorization`` along; a body that is not a JSON
object is the client's 400 naming ``body`` first, as on the generation paths. A worker without the
path (404: a fleet can mix engines, and only vLLM has ``/v2/rerank``) or that cannot be reached is
passed over for the next; with none left the last 404 is the answer, or a 502 when none answered,
a 503 when none is routable. A client that leaves before the answer begins closes the connection
to the worker, which aborts the request (vLLM's pooling routes are cancelled on a disconnect).

Inside an engine, the middleware leaves these paths to the engine's own server.
"""

from __future__ import annotations

import functools
import random
from collections import Counter
from collections.abc import Callable
from typing import Any

from kvmesh._http import route_path
from kvmesh.errors import RequestError
from kvmesh.router.asgi import peer_auth
from kvmesh.router.asgi.forwarding import open_while_client_waits, relay_unchanged
from kvmesh.router.asgi.json_io import read_json_body, send_error
from kvmesh.router.mesh.runtime import Mesh
from kvmesh.router.upstream.forwarder import UpstreamError, UpstreamResponse, end_to_end_headers

PATHS = (
    "/v1/embeddings",
    "/v2/embed",
    "/pooling",
    "/encode",
    "/classify",
    "/v1/classify",
    "/score",
    "/v1/score",
    "/rerank",
    "/v1/rerank",
    "/v2/rerank",
    "/v1/decisions",
)
"""Asked with a POST (SGLang takes a PUT on :data:`PUT_PATHS` too)."""
PUT_PATHS = ("/encode", "/classify", "/v1/rerank")


class PoolingRelay:
    """An ASGI app serving :data:`PATHS` from the least loaded worker that has the path (see the
    module docstring)."""

    def __init__(self, mesh_of: Callable[[], Mesh]) -> None:
        self._mesh_of = mesh_of  # (the router's mesh exists only once the middleware is built)
        self._turn = 0
        self.in_flight: Counter[str] = Counter()
        """The body bytes of the pooling requests sent to each worker and not answered yet."""

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        mesh = self._mesh_of()
        await mesh.ensure_started()
        settings = mesh.settings
        endpoint = route_path(scope)
        try:
            body = await read_json_body(scope, receive, settings.max_body_bytes, settings.body_read_timeout)
        except RequestError as e:
            mesh.metrics.requests.labels(endpoint, "rejected", str(e.status)).inc()
            await send_error(send, e.status, str(e), e.field)
            return
        if body is None:
            return  # the client left
        if not mesh.registry.ready.is_set():
            await mesh.wait_ready()
        order = self._order(mesh)
        if not order:
            mesh.metrics.requests.labels(endpoint, "rejected", "503").inc()
            await send_error(send, 503, "no worker is routable", None)
            return
        path = endpoint
        if scope.get("query_string"):
            path += "?" + scope["query_string"].decode("latin-1")
        headers = peer_auth.strip_internal(end_to_end_headers(scope["headers"]))
        method = scope["method"]
        answer: UpstreamResponse | None = None
        answered_by = ""
        for worker_id in order:
            worker = mesh.registry.get(worker_id)
            if worker is None:
                continue
            self.in_flight[worker_id] += len(body)
            try:
                opening = functools.partial(mesh.forwarder.open, worker.url, method, path, headers, body)
                upstream = await open_while_client_waits(receive, opening, _close)
            except UpstreamError:
                continue
            finally:
                self._done(worker_id, len(body))
            if upstream is None:  # the client left before the worker answered
                if answer is not None:
                    answer.close()
                mesh.metrics.requests.labels(endpoint, "disconnected", "499").inc()
                return
            if answer is not None:
                answer.close()
            answer, answered_by = upstream, worker_id
            if upstream.status != 404:  # (404: not this engine's path, ask the next one)
                break
        if answer is None:
            mesh.metrics.requests.labels(endpoint, "rejected", "502").inc()
            await send_error(send, 502, f"no worker could be reached for {endpoint}", None)
            return
        mesh.metrics.requests.labels(endpoint, "pooling", str(answer.status)).inc()
        answer.headers.append((b"x-kvmesh-worker-id", answered_by.encode()))
        await relay_unchanged(answer, send)

    def _order(self, mesh: Mesh) -> list[str]:
        """The routable workers in the order they are asked: least work outstanding first, ties in
        turn; with ``--router-mode round-robin`` in turn, with ``random`` at random."""
        routable = sorted(mesh.registry.routable)
        if not routable:
            return []
        mode = mesh.config.router_mode
        if mode == "random":
            random.shuffle(routable)
            return routable
        self._turn += 1
        start = self._turn % len(routable)
        in_turn = routable[start:] + routable[:start]
        if mode == "round-robin":
            return in_turn
        return sorted(in_turn, key=self.in_flight.__getitem__)  # (the sort is stable: ties in turn)

    def _done(self, worker_id: str, size: int) -> None:
        self.in_flight[worker_id] -= size
        if self.in_flight[worker_id] <= 0:
            del self.in_flight[worker_id]


def _close(upstream: UpstreamResponse) -> None:
    upstream.close()
