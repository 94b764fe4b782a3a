"""SageMaker's ``POST /invocations`` in front of vLLM, SGLang and the standalone router's fleet.

A SageMaker container answers on ``/invocations`` alone, so every request of such a deployment
came through it, and the router passed them all by: no prefix routing at all. Now a body that is a
generation (:func:`~kvmesh.router.request.invocations.invoked_endpoint`: ``messages`` for chat,
``prompt`` for a completion) is routed as that request is, on its prompt's blocks. Its path stays
``/invocations`` on the way to the engine (local or a peer), so the engine's own SageMaker handling
(its adapter header, its session checks) still applies; the request is parsed, hashed and counted
as the chat request or completion it is.

Any other body (an embedding, a score, a session's own ``requestType`` request) goes on unrouted:
to the engine behind the middleware, or from the standalone router to one worker, as a pooling
request goes (:mod:`.pooling`).

A stateful session lives in the engine that opened it. The router learns where from the answer
that opened it (its new-session header; from the standalone router's relay, the worker it names),
and a request naming the session in its session header then goes there, generation or not; a
request naming a session the router does not know goes, in an engine, to that engine (SageMaker's
sticky routing sent it there), and from the standalone router where it is routed (the engine that
lacks the session answers the 400). The answer that closes a session makes the router forget it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvmesh.router.asgi.forwarding import WORKER_ID_HEADER
from kvmesh.router.mesh.registry import WorkerRegistry
from kvmesh.router.mesh.runtime import Mesh
from kvmesh.router.request.invocations import INVOCATIONS_PATH, adapter_lora, closed_session, opened_session


def lora_reading(
    registry: WorkerRegistry, path: str, headers: Sequence[tuple[bytes, bytes]]
) -> Callable[[Any], str | None]:
    """How a request on ``path`` names its LoRA adapter: by its body's ``model``; on
    ``/invocations``, as vLLM reads it (SageMaker's adapter header, or the base model), unless
    every routable worker is SGLang's, whose ``/invocations`` is its chat route."""
    if path != INVOCATIONS_PATH:
        return registry.lora_of
    routable = registry.routable
    if routable and registry.described(routable, lambda info: info.backend == "sglang") == routable:
        return registry.lora_of
    return adapter_lora(headers, registry.lora_of)


def learning_sessions(mesh: Mesh, send: Any) -> Any:
    """``send``, remembering the session an answer opens (and forgetting the one it closes) in
    ``mesh.session_homes``: at the worker the answer names, or at this engine when it names none."""

    async def watching_send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            headers = message.get("headers") or []
            opened = opened_session(headers)
            closed = closed_session(headers)
            if opened is not None:
                worker = next((v.decode("latin-1") for k, v in headers if k == WORKER_ID_HEADER), None)
                worker = worker or mesh.settings.self_worker_id
                if worker is not None:
                    mesh.session_homes.remember(opened, worker)
            if closed is not None:
                mesh.session_homes.forget(closed)
        await send(message)

    return watching_send


__all__ = ["learning_sessions", "lora_reading"]
