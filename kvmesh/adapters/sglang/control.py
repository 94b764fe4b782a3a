"""A small request/answer channel from SGLang's HTTP server to each scheduler (one per DP rank).

Pins must touch the radix cache in the scheduler process, in the scheduler's thread. SGLang's own
HTTP -> scheduler path (``TokenizerManager`` -> ZMQ -> ``Scheduler._request_dispatcher``) has no
slot for a plugin's request types without patching both ends; this channel is kvmesh's own and
needs no change to SGLang's messages. Each scheduler that holds a KV cache binds a ZMQ ROUTER at
``<base>-dp<rank>`` (``base`` from ``KVMESH_SGLANG_CONTROL``, set by the launcher and inherited by
SGLang's subprocesses) and the scheduler hook drains it without blocking once per loop iteration
(:mod:`.scheduler_hooks`). The HTTP side sends one JSON request per call and waits for the answer.

Messages are JSON objects: ``{"op": "pin_prefix", "token_ids": [...], "ttl_seconds": s}``,
``{"op": "tick"}``, ``{"op": "stats"}``; answers are JSON objects, ``{"error": ...}`` on failure.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from kvmesh.errors import RequestError

logger = logging.getLogger("kvmesh.adapters.sglang")

CONTROL_ENV = "KVMESH_SGLANG_CONTROL"
_MAX_PER_DRAIN = 64


def control_endpoint(base: str, dp_rank: int) -> str:
    return f"{base}-dp{dp_rank}"


class ControlServer:
    """The scheduler's end: a bound ROUTER, drained without blocking by :meth:`serve_pending`."""

    def __init__(self, endpoint: str, handle: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        self.endpoint = endpoint
        self._handle = handle
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(endpoint)

    def serve_pending(self) -> int:
        """Answer every request already waiting (at most a bounded number); returns how many."""
        served = 0
        while served < _MAX_PER_DRAIN:
            try:
                ident, payload = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            except ValueError:
                continue  # a message of the wrong shape: not from kvmesh
            served += 1
            try:
                request = json.loads(payload)
                answer = self._handle(request) if isinstance(request, dict) else {"error": "not an object"}
            except RequestError as e:
                answer = {"error": str(e), "status": e.status}
            except Exception as e:  # never let a control request take the scheduler down
                logger.exception("kvmesh: control request failed")
                answer = {"error": f"{type(e).__name__}: {e}"}
            self._sock.send_multipart([ident, json.dumps(answer).encode()])
        return served

    def close(self) -> None:
        self._sock.close(linger=0)


async def call(endpoint: str, request: dict[str, Any], *, timeout: float = 10.0) -> dict[str, Any]:
    """Send ``request`` to one scheduler and return its answer; RequestError 503 when it does not
    answer within ``timeout`` seconds (the scheduler is busy with a long step, or down)."""
    ctx = zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        await sock.send(json.dumps(request).encode())
        if not await sock.poll(int(timeout * 1000)):
            raise RequestError(
                f"SGLang's scheduler did not answer kvmesh's {request.get('op')!r}", status=503
            )
        answer = json.loads(await sock.recv())
    finally:
        sock.close(linger=0)
    if not isinstance(answer, dict):
        raise RequestError("SGLang's scheduler sent a malformed kvmesh answer", status=503)
    if "error" in answer:
        raise RequestError(str(answer["error"]), status=int(answer.get("status", 503)))
    return answer
