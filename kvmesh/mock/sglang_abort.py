"""SGLang's request ids (``rid``) and its abort (``POST /abort_request``) on the mock engine, as
SGLang 0.5.23 has them.

A client names a request by the ``rid`` it sends on ``/generate``, ``/v1/chat/completions`` or
``/v1/completions``: one string (a list gives each prompt of a ``/generate`` batch its own, and a
batch's string ``rid`` is its prompts' ``rid_0``, ``rid_1``, ... as SGLang numbers them
(:mod:`kvmesh.mock.batches`); a list for one prompt, or a rid of another kind, is a 400 naming
``rid``). Each prompt of a batch is a request of its own here, so an abort of ``rid_1`` stops that
prompt only. The server keeps its requests by rid
(:class:`~kvmesh.mock.running.RunningRequests`) until their answers are over; a request without one
is reached by ``abort_all`` only.

``/abort_request`` takes ``{"rid", "abort_all"}`` as the router reads it
(:func:`~kvmesh.router.request.generate_api.abort_body`: a 400 naming the field for a body that is
not an object, a ``rid`` that is not a string or null, an ``abort_all`` that is not a boolean);
``AbortReq``'s other fields (``abort_message`` ...) are taken and change nothing, as SGLang's route
passes on those two only. It answers 200 with an empty body, whatever it stopped:

- ``abort_all``: every request in the engine, whatever API it came by (one of the Responses or
  Messages API then ends as when the engine stops, one of vLLM's token API as vLLM ends an abort);
- else a ``rid`` some request has exactly: that request and every other whose rid begins with it
  (SGLang's tokenizer drops an abort of a rid it does not hold, with its default one tokenizer
  worker; the scheduler then stops every request whose rid starts with it);
- else (no rid, ``""``, one no request has): nothing.

With ``n`` > 1 the abort of the request's rid stops every choice, as a client aborting the request
means (SGLang gives each sample a fresh rid, so there it stops none of them; the samples' own ids in
``meta_info.id`` name nothing here). An aborted request is answered, not cut off as one
whose client left or whose engine stopped (:attr:`~kvmesh.mock.engine.TokenStream.abort_requested`):
its tokens so far with the finish reason :func:`abort_reason` on ``/generate``, ``"abort"`` on the
OpenAI APIs, a stream's last event saying so before ``data: [DONE]``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvmesh.errors import RequestError
from kvmesh.mock.engine import MockEngine, TokenStream
from kvmesh.mock.running import RunningRequests
from kvmesh.router.request.generate_api import abort_body


def request_rid(body: Mapping[str, Any]) -> str | None:
    """The ``rid`` a request of one prompt names itself by (None for none, or ``""``); a 400
    naming it for a list (a batch's: one rid a prompt) or anything but a string."""
    rid = body.get("rid")
    if isinstance(rid, list):
        raise RequestError(
            "'rid' as a list gives each prompt of a batch its rid; a request of one prompt takes one string",
            field="rid",
        )
    if rid is not None and not isinstance(rid, str):
        raise RequestError("'rid' must be a string", field="rid")
    return rid or None


def abort_request(body: Any, engine: MockEngine, running: RunningRequests) -> None:
    """Stop what an ``/abort_request`` body names (a RequestError naming the field for a bad one)."""
    checked = abort_body(body)
    if checked.get("abort_all", False):
        engine.abort_all(requested=True)
        return
    rid = checked.get("rid")
    if not rid or rid not in running:
        return
    for stream in running.prefixed(rid):
        engine.abort(stream.request_id, requested=True)


def abort_reason(stream: TokenStream) -> dict[str, Any]:
    """``meta_info.finish_reason`` of an aborted ``/generate`` answer: SGLang's for a request it
    stopped running, or for one it took out of its queue before a step ran it."""
    if stream.scheduled_time is None:
        return {"type": "abort", "message": "Abort in waiting queue"}
    return {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
