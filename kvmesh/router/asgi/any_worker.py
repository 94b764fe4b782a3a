"""The standalone router's answer to an engine's utility endpoints, which any worker answers alike:
Anthropic's ``POST /v1/messages/count_tokens`` (Claude Code asks it of the server it talks to),
``POST /tokenize`` / ``/detokenize`` (vLLM's and SGLang's, and SGLang's ``/v1/`` twins), SGLang's
parsers (``POST /parse_function_call``, ``/separate_reasoning``), vLLM's renderers (``POST
/v1/chat/completions/render`` and its kin: a request rendered into the token-id request its
``/inference/v1/generate`` takes, which the router then routes), and the descriptions a client reads
at start: SGLang's ``GET /get_model_info`` and ``/get_server_info`` (with their newer names
``/model_info``, ``/server_info``; RL frameworks read them from the address they generate at) and
vLLM's ``GET /version`` and ``/tokenizer_info`` (a client that tokenizes for itself reads it), and Ollama's ``GET /api/tags`` and ``POST /api/show`` (as SGLang serves
them: an Ollama client lists the models before it chats); and SGLang's ``GET /health_generate``
(one worker generates a token: the fleet can serve). A server description is the one worker's that answered.

Nothing about them is cached or routed, but a client pointed at the router expects them where its
generation requests go; the router had only a 404 for them. A POST body that is not a JSON object,
or is nested deeper than a generation request may be, is the client's 400 naming ``body``, as on
the generation paths (an engine's own parser can fail on it with a 500). Each is sent to one
routable worker, taken in turn, and its answer relayed unchanged (the client's ``authorization``
goes along). A worker whose server has no such path answers 404, and the next worker is asked (a
fleet can mix engines: SGLang alone has ``/v1/tokenize``), as is one that cannot be reached; with no
worker left, the last 404 is the answer, or a 502 when none answered, a 503 when none is routable.
A client that leaves before the answer begins closes the connection to the worker, which tells it
to abort what it started for the request.

Inside an engine, the middleware leaves these paths to the engine's own server, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
from collections.abc import Awaitable, Callable
from typing import Any

from kvmesh._http import route_path
from kvmesh.errors import RequestError
from kvmesh.router.asgi import peer_auth
from kvmesh.router.asgi.forwarding import open_while_client_waits, relay_unchanged
from kvmesh.router.asgi.json_io import read_json_body, send_error
from kvmesh.router.mesh.holder_search import Unanswered
from kvmesh.router.mesh.runtime import Mesh
from kvmesh.router.request.responses_api import ResponseHomes
from kvmesh.router.upstream.forwarder import UpstreamError, UpstreamResponse, end_to_end_headers

PATHS = (
    "/v1/messages/count_tokens",
    "/tokenize",
    "/detokenize",
    "/v1/tokenize",
    "/v1/detokenize",
    "/parse_function_call",
    "/separate_reasoning",
    # vLLM's renderers (its scale-out API): a request rendered into the token-id request that
    # /inference/v1/generate takes, and back
    "/v1/chat/completions/render",
    "/v1/completions/render",
    "/v1/responses/render",
    "/v1/messages/render",
    "/v1/chat/completions/derender",
    "/v1/completions/derender",
    "/api/show",  # (Ollama's API, as SGLang serves it: a model's description)
)
"""Asked with a POST."""
READ_PATHS = (
    "/get_model_info",
    "/model_info",
    "/get_server_info",
    "/server_info",
    "/version",
    "/tokenizer_info",  # (vLLM's, served with --enable-tokenizer-info-endpoint)
    "/health_generate",
    "/api/tags",  # (Ollama's list of models, as SGLang serves it)
)
"""Asked with a GET."""


class AnyWorker:
    """An ASGI app serving :data:`PATHS` and :data:`READ_PATHS` from whichever worker answers (see
    the module docstring)."""

    def __init__(self, mesh_of: Callable[[], Mesh]) -> None:
        self._mesh_of = mesh_of  # (the router's mesh exists only once the middleware is built)
        self._turn = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        mesh = self._mesh_of()
        await mesh.ensure_started()
        settings = mesh.settings
        body: bytes | None = b""
        if scope["method"] == "POST":
            try:
                body = await read_json_body(
                    scope, receive, settings.max_body_bytes, settings.body_read_timeout
                )
            except RequestError as e:
                await send_error(send, e.status, str(e), e.field)
                return
        if body is None:
            return  # the client left
        if not mesh.registry.ready.is_set():
            await mesh.wait_ready()
        routable = sorted(mesh.registry.routable)
        if not routable:
            await send_error(send, 503, "no worker is routable", None)
            return
        self._turn += 1
        start = self._turn % len(routable)
        asked = await first_answer(mesh, routable[start:] + routable[:start], scope, receive, body)
        if asked is CLIENT_LEFT:
            return
        if asked is None:
            await send_error(send, 502, f"no worker could be reached for {route_path(scope)}", None)
            return
        await relay_unchanged(asked[0], send)


class _Left(enum.Enum):
    CLIENT = "the client left"


CLIENT_LEFT = _Left.CLIENT
""":func:`first_answer`'s answer when the client left before any worker answered."""


async def first_answer(
    mesh: Mesh,
    order: list[str],
    scope: dict[str, Any],
    receive: Any,
    body: bytes,
    weigh: Callable[[str], contextlib.AbstractContextManager[object]] | None = None,
) -> tuple[UpstreamResponse, str] | _Left | None:
    """The request of ``scope`` (its method, path, query, end-to-end headers, and ``body``) asked of
    the workers of ``order`` one after another, until one answers other than 404 (a path its
    server lacks) or none is left: (the answer, the worker that gave it), the last 404 when every
    worker reached had none, None when no worker could be reached. A client that leaves while a
    worker prepares its answer closes the connection to it, which aborts the request there
    (:data:`CLIENT_LEFT`). ``weigh(worker id)`` holds for as long as that worker is asked."""
    path = route_path(scope)
    if scope.get("query_string"):
        path += "?" + scope["query_string"].decode("latin-1")
    headers = peer_auth.strip_internal(end_to_end_headers(scope["headers"]))
    method = scope["method"]
    answer: tuple[UpstreamResponse, str] | None = None
    for worker_id in order:
        worker = mesh.registry.get(worker_id)
        if worker is None:
            continue
        opening = functools.partial(mesh.forwarder.open, worker.url, method, path, headers, body)
        try:
            with weigh(worker_id) if weigh is not None else contextlib.nullcontext():
                upstream = await open_while_client_waits(receive, opening, _close)
        except UpstreamError:
            continue
        if answer is not None:
            answer[0].close()
        if upstream is None:
            return CLIENT_LEFT
        answer = (upstream, worker_id)
        if upstream.status != 404:
            break
    return answer


async def first_holder(
    workers: list[Any], holds: Callable[[Any], Awaitable[bool]], homes: ResponseHomes, key: str
) -> str | None:
    """The id of the first of ``workers`` (in order) for which ``holds`` says yes, asked of all at
    once, remembered in ``homes`` as ``key``'s; None when every one says no, and
    :class:`~kvmesh.router.mesh.holder_search.Unanswered` when none says yes but an ask failed (that
    worker may hold it: no miss to remember)."""
    answers = await asyncio.gather(*(holds(w) for w in workers), return_exceptions=True)
    holder = next((w for w, said in zip(workers, answers, strict=True) if said is True), None)
    if holder is None:
        if any(isinstance(said, BaseException) for said in answers):
            raise Unanswered(key)
        return None
    homes.remember(key, holder.worker_id)
    return str(holder.worker_id)


def _close(upstream: UpstreamResponse) -> None:
    upstream.close()
