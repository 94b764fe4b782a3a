"""The standalone router's answer to the engines' pooling requests: embeddings, classification,
scores and reranking (vLLM 0.33's ``/v1/embeddings``, ``/v2/embed``, ``/pooling``, ``/classify``,
``/score``, ``/v1/score``, ``/rerank``, ``/v1/rerank``, ``/v2/rerank``; SGLang 0.5.23's
``/v1/embeddings``, ``/encode``, ``/classify``, ``/v1/classify``, ``/v1/rerank``, and its
``/v1/score`` and ``/v1/decisions``, which score label tokens on a generating model); and what
scores or transcribes on a generating model, with no prefix to share: both engines' System One
decisions (``/v1/systemone``), vLLM's ``/generative_scoring``, and speech to text
(``/v1/audio/transcriptions``, both engines; vLLM's ``/v1/audio/translations``), whose body is a
form carrying the audio, relayed as it came (``--max-upload-bytes`` bounds it: 32 MiB by default,
above vLLM's 25 MB clip limit, so the engine says what is too long).

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
object (but for speech to text's form) is the client's 400 naming ``body`` first, as on the
generation paths. A worker without the
path (404: a fleet can mix engines, and only vLLM has ``/v2/rerank``) or that cannot be reached is
passed over for the next; with none left the last 404 is the answer, or a 502 when none answered,
a 503 when none is routable. A client that leaves before the answer begins closes the connection
to the worker, which aborts the request (vLLM's pooling routes are cancelled on a disconnect).

SageMaker's ``/invocations`` comes here when its body is not a generation (the middleware routes
those: :mod:`.invocations`), such as an embedding request or a stateful session's own request; one
that names a session the router saw opened goes to the worker that opened it.

Inside an engine, the middleware leaves these paths to the engine's own server.
"""

from __future__ import annotations

import contextlib
import random
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from kvmesh._http import route_path
from kvmesh.errors import RequestError
from kvmesh.router.asgi.any_worker import CLIENT_LEFT, first_answer
from kvmesh.router.asgi.forwarding import WORKER_ID_HEADER, relay_unchanged
from kvmesh.router.asgi.json_io import read_body, read_json_body, send_error
from kvmesh.router.mesh.runtime import Mesh
from kvmesh.router.request.invocations import INVOCATIONS_PATH, session_id

FORM_PATHS = ("/v1/audio/transcriptions", "/v1/audio/translations")
"""Speech to text, whose body is a form with the audio file, not JSON (the module docstring)."""
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
    "/v1/systemone",
    "/generative_scoring",
    *FORM_PATHS,
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
        timeout = settings.body_read_timeout
        try:
            if endpoint in FORM_PATHS:  # (the audio, relayed unread: its own bound)
                body = await read_body(scope, receive, settings.max_upload_bytes, timeout)
            else:
                body = await read_json_body(scope, receive, settings.max_body_bytes, timeout)
        except RequestError as e:
            mesh.metrics.requests.labels(endpoint, "rejected", str(e.status)).inc()
            await send_error(send, e.status, str(e), e.field)
            return
        if body is None:
            return  # the client left
        if not mesh.registry.ready.is_set():
            await mesh.wait_ready()
        order = self._order(mesh)
        if endpoint == INVOCATIONS_PATH and (session := session_id(scope["headers"])):
            # (SageMaker's stateful session lives on one engine: its own requests go there)
            home = mesh.session_homes.home(session)
            order = [home] if home in order else order
        if not order:
            mesh.metrics.requests.labels(endpoint, "rejected", "503").inc()
            await send_error(send, 503, "no worker is routable", None)
            return
        asked = await first_answer(mesh, order, scope, receive, body, self._weighing(len(body)))
        if asked is CLIENT_LEFT:
            mesh.metrics.requests.labels(endpoint, "disconnected", "499").inc()
            return
        if asked is None:
            mesh.metrics.requests.labels(endpoint, "rejected", "502").inc()
            await send_error(send, 502, f"no worker could be reached for {endpoint}", None)
            return
        answer, answered_by = asked
        mesh.metrics.requests.labels(endpoint, "pooling", str(answer.status)).inc()
        answer.headers.append((WORKER_ID_HEADER, answered_by.encode()))
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

    def _weighing(self, size: int) -> Callable[[str], contextlib.AbstractContextManager[object]]:
        """For :func:`first_answer`: ``size`` bytes outstanding on a worker while it is asked."""

        @contextlib.contextmanager
        def weigh(worker_id: str) -> Iterator[None]:
            self.in_flight[worker_id] += size
            try:
                yield
            finally:
                self.in_flight[worker_id] -= size
                if self.in_flight[worker_id] <= 0:
                    del self.in_flight[worker_id]

        return weigh
