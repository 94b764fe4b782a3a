"""SageMaker's entry point, ``POST /invocations``, read as the generation request its body is.

vLLM and SGLang both serve it (a SageMaker container must answer there): vLLM 0.33 validates the
body as a chat request, then as a completion, then as its pooling requests, and serves the first
that fits; SGLang 0.5.23 serves it as a chat request. :func:`invoked_endpoint` reads a body the same
way: ``messages`` makes it a chat request, ``prompt`` a completion. Anything else (an embedding, a
score, a stateful session's own request) is not a generation, and the router does not route it.

SageMaker's stateful sessions live in one engine's memory: a ``{"requestType": "NEW_SESSION"}``
body opens one there, whose id comes back in :data:`NEW_SESSION_HEADER`; later requests carry it
in :data:`SESSION_HEADER`, and ``{"requestType": "CLOSE"}`` ends it. Another engine answers such a
request with a 400 (no such session), so a request with a session belongs to the engine that holds it.

SageMaker names a LoRA adapter in :data:`ADAPTER_HEADER`, and vLLM 0.33 serves the request with
that adapter: its SageMaker handling (``model-hosting-container-standards``) writes the header's
value into the body's ``model`` before the body is read, and without the header writes null there,
so the served model's base answers whatever the body named. The router reads it the same way
(:func:`adapter_lora`), so the request is hashed in the adapter's blocks, or the base model's, and
goes only to workers serving them. SGLang 0.5.23 serves ``/invocations`` as its chat route, which
reads the body's ``model`` and not the header: in front of SGLang alone, the router reads the body
(``kvmesh.router.asgi.invocations.lora_reading``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvmesh.router.request.parse import CHAT_ENDPOINT, COMPLETIONS_ENDPOINT

INVOCATIONS_PATH = "/invocations"
SESSION_HEADER = b"x-amzn-sagemaker-session-id"
NEW_SESSION_HEADER = b"x-amzn-sagemaker-new-session-id"
"""The answer to a NEW_SESSION request: ``<id>; Expires=<UTC time>``."""
CLOSED_SESSION_HEADER = b"x-amzn-sagemaker-closed-session-id"
ADAPTER_HEADER = b"x-amzn-sagemaker-adapter-identifier"


def invoked_endpoint(body: dict[str, Any]) -> str | None:
    """The generation endpoint an ``/invocations`` body is served as, or None when it is none
    (see the module docstring). A session request (``requestType``) is never a generation."""
    if "requestType" in body:
        return None
    if "messages" in body:
        return CHAT_ENDPOINT
    if "prompt" in body:
        return COMPLETIONS_ENDPOINT
    return None


def session_id(headers: Sequence[tuple[bytes, bytes]]) -> str | None:
    """The stateful session a request names (:data:`SESSION_HEADER`), or None."""
    return _header(headers, SESSION_HEADER)


def opened_session(headers: Sequence[tuple[bytes, bytes]]) -> str | None:
    """The id of the session an answer opened (:data:`NEW_SESSION_HEADER`, before its
    ``; Expires=``), or None."""
    value = _header(headers, NEW_SESSION_HEADER)
    if value is None:
        return None
    return value.split(";", 1)[0].strip() or None


def closed_session(headers: Sequence[tuple[bytes, bytes]]) -> str | None:
    """The id of the session an answer closed (:data:`CLOSED_SESSION_HEADER`), or None."""
    return _header(headers, CLOSED_SESSION_HEADER)


def adapter_lora(
    headers: Sequence[tuple[bytes, bytes]], lora_of: Callable[[Any], str | None]
) -> Callable[[Any], str | None]:
    """``lora_of`` (a request's model to the LoRA adapter it names) for an ``/invocations``
    request served by vLLM: the adapter :data:`ADAPTER_HEADER` names, or none, stands in for the
    body's model, as vLLM puts it there."""
    named = _header(headers, ADAPTER_HEADER)
    return lambda _model: lora_of(named) if named is not None else None


def _header(headers: Sequence[tuple[bytes, bytes]], name: bytes) -> str | None:
    """The value of header ``name`` (lowercase; matched in any case), stripped, or None when
    absent or blank."""
    for key, value in headers:
        if key.lower() == name:
            return value.decode("latin-1").strip() or None
    return None


__all__ = [
    "ADAPTER_HEADER",
    "CLOSED_SESSION_HEADER",
    "INVOCATIONS_PATH",
    "NEW_SESSION_HEADER",
    "SESSION_HEADER",
    "adapter_lora",
    "closed_session",
    "invoked_endpoint",
    "opened_session",
    "session_id",
]
