"""A batch of prompts in one request, served by the mock engine as vLLM 0.33.0 and SGLang 0.5.23
serve it: ``/v1/completions`` with ``prompt`` a list of prompts (texts, or lists of token ids), and
SGLang's ``/generate`` with ``text`` a list (or ``input_ids`` a list of lists).

An engine runs each prompt of a batch as a request of its own and answers the batch with one
response; a client or an sglang-router talking to the mock directly must get that, not the refusal
of a body the router in front would have cut up. So the mock cuts the body as the router does
(:func:`~kvmesh.router.request.batches.split_batch`: a string ``rid`` numbered ``rid_0``,
``rid_1``, ... as SGLang numbers it, a per-prompt list giving each prompt its entry, a list of the
wrong length a 400 naming it), and checks every prompt before any of them runs, as the engines
validate a batch before generating: one bad prompt is the whole batch's 400, its field named as the
batch's body has it (``text[1]``, ``sampling_params[1].max_new_tokens``), and nothing reached the
engine.

Each prompt is then served as the mock serves one request (its own engine requests, known to
``/abort_request`` by its own rid, so an abort of ``rid_1`` stops that prompt only), and the answers
are put together in the engine's batch shape by the router's merging
(:class:`~kvmesh.router.asgi.batches.BatchAnswer`), which reproduces it: one completion whose
``choices`` are numbered ``prompt * n + choice`` and whose usage is summed, or SGLang's list of
results; a stream of every prompt's events as they come, renumbered so under one completion id,
with ``[DONE]`` once (and a completion's summed usage chunk just before it). A client that leaves
stops every prompt's requests: each prompt's request sees its client leave.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from kvmesh.errors import RequestError
from kvmesh.router.asgi.batches import BatchAnswer
from kvmesh.router.request.batches import CHAT_BATCH_PATH, PromptBatch, split_batch
from kvmesh.router.request.vertex_api import VERTEX_PATH, vertex_batch


class BatchResponse:
    """The ASGI answer to a checked batch: each prompt's body served by ``serve_one`` (the mock's
    handler of one request of the endpoint), the answers merged in the engine's batch shape."""

    def __init__(
        self,
        batch: PromptBatch,
        endpoint: str,
        stream: bool,
        serve_one: Callable[[Request], Awaitable[Response]],
    ) -> None:
        self.batch = batch
        self.endpoint = endpoint
        self.stream = stream
        self.serve_one = serve_one

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def run_one(scope: Scope, receive: Receive, send: Send) -> None:
            response = await self.serve_one(Request(scope, receive))
            await response(scope, receive, send)

        answer = BatchAnswer(run_one, dict(scope), receive, send, self.batch, self.endpoint, self.stream)
        await answer.run()


def batch_response(
    body: Any,
    endpoint: str,
    read_one: Callable[[dict[str, Any]], object],
    serve_one: Callable[[Request], Awaitable[Response]],
) -> BatchResponse | None:
    """The answer to the batch ``body`` carries, or None for a body of one prompt (a completions
    ``prompt`` list of one included: the engines take it as that prompt). Every prompt's body is
    read by ``read_one`` (the endpoint's parser) first; a RequestError is the batch's, naming the
    field in the batch's body."""
    if not isinstance(body, dict):
        return None
    batch = split_batch(body, endpoint)
    if batch is None:
        return None
    _read_each(batch, "conversation" if endpoint == CHAT_BATCH_PATH else batch.unit, read_one)
    return BatchResponse(batch, endpoint, body.get("stream") is True, serve_one)


def vertex_response(
    body: Any,
    read_one: Callable[[dict[str, Any]], object],
    serve_one: Callable[[Request], Awaitable[Response]],
) -> Response:
    """The answer to a Vertex AI prediction body (SGLang's ``/vertex_generate``): its instances
    served as a ``/generate`` batch by ``serve_one``, answered as ``{"predictions": [...]}``; no
    instances, an empty list, as SGLang answers it."""
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object", field="body")
    batch = vertex_batch(body)
    if not batch.items:
        return JSONResponse([])
    _read_each(batch, batch.unit, read_one)
    stream = batch.items[0].get("stream") is True
    return BatchResponse(batch, VERTEX_PATH, stream, serve_one)  # type: ignore[return-value]


def _read_each(batch: PromptBatch, unit: str, read_one: Callable[[dict[str, Any]], object]) -> None:
    for index, item in enumerate(batch.items):
        try:
            read_one(item)
        except RequestError as e:
            raise RequestError(
                f"{unit} {index} of the batch: {e}", field=batch.field(e.field, index), status=e.status
            ) from None


__all__ = ["BatchResponse", "batch_response", "vertex_response"]
