"""A streamed answer's tokens written to the client from the worker connection's socket callback.

Each token of a streamed answer reaches the front as one chunk from the worker. Relayed through
ASGI, every chunk costs a wake-up of the relay task (a future resolved, a task step), an ASGI
message and the server's ``send`` coroutine, on top of the two socket calls any proxy makes. Where
the server is uvicorn's httptools protocol, :class:`DirectRelay` writes the chunk to the client's
transport from the worker connection's ``data_received`` instead, framed as uvicorn frames a
chunked body, and the tap reads it right after. ``benchmarks/relay.py`` measures what that saves.

That needs uvicorn's own ``send``: the standalone ``kvmesh router`` is handed it, and an engine's
app (vLLM, SGLang, TensorRT-LLM, the mock) hands its middleware the ``send`` of Starlette's
outermost layer, ``ServerErrorMiddleware``, which passes every message on unchanged (it only notes
that the response has started). That one wrapper is looked through; any other (a middleware
outside kvmesh's that may rewrite the body, such as compression) keeps the ASGI path.

It takes a chunk only where that changes nothing the client or the router can see, and hands any
other chunk back to the ASGI path, which goes on as before:

* the ``send`` the app was given is uvicorn's own httptools ``send``, alone or inside Starlette's
  ``ServerErrorMiddleware`` only, and the response is started, chunked and not complete;
* the tap would pass the chunk on unchanged (``ResponseTap.takes_as_is``: past the first token,
  whole SSE lines, no ``[DONE]``, nothing to splice in);
* the client is still connected and its transport has not asked the writer to pause: a slow
  client is waited for in ``send``, as before.

``KVMESH_DIRECT_RELAY=0`` in the environment turns it off (every chunk then goes through ``send``).
``kvmesh_relayed_chunks_total`` counts the chunks each way.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from kvmesh.router.asgi.tap import ResponseTap

log = logging.getLogger(__name__)

_UVICORN_HTTPTOOLS = "uvicorn.protocols.http.httptools_impl"
_STARLETTE_OUTERMOST = ("starlette.middleware.errors", "ServerErrorMiddleware.__call__.<locals>._send")
ENABLED = os.environ.get("KVMESH_DIRECT_RELAY", "1").strip().lower() not in ("0", "false", "no", "off")


class DirectRelay:
    """One response's writer of whole chunks to the client, callable as a connection's
    ``relay_hook``: True when it has written and read ``data``, False to leave it to ``send``."""

    __slots__ = ("_cycle", "_flow", "_tap", "_transport", "written")

    def __init__(self, cycle: Any, tap: ResponseTap) -> None:
        self._cycle = cycle
        self._flow = cycle.flow
        self._transport = cycle.transport
        self._tap = tap
        self.written = 0
        """Chunks written this way."""

    @classmethod
    def under(cls, send: Any, tap: ResponseTap) -> DirectRelay | None:
        """A writer for the response ``send`` has started, or None where the server is not one
        this can write for (or it is turned off)."""
        if not ENABLED:
            return None
        send = _inside_server_errors(send)
        cycle = getattr(send, "__self__", None)
        if cycle is None or type(cycle).__module__ != _UVICORN_HTTPTOOLS:
            return None
        try:
            if getattr(send, "__func__", None) is not type(cycle).send:
                return None
            ready = cycle.chunked_encoding is True and cycle.response_started and not cycle.response_complete
            if not ready or cycle.transport is None or not hasattr(cycle.flow, "write_paused"):
                return None
            return cls(cycle, tap)
        except AttributeError:  # a uvicorn whose cycle is not laid out as this one expects
            return None

    def __call__(self, data: bytes) -> bool:
        tap = self._tap
        if self._cycle.disconnected or self._flow.write_paused or not tap.takes_as_is(data):
            return False
        # uvicorn's own framing of a chunked body (httptools_impl's send).
        self._transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        self.written += 1
        try:
            tap.read_as_is(data)
        except Exception:  # the bytes are the client's already: a fault here must not lose them
            log.exception("reading a relayed chunk failed")
        return True


def _inside_server_errors(send: Any) -> Any:
    """The ``send`` Starlette's ``ServerErrorMiddleware`` wraps, when ``send`` is its wrapper (it
    passes every message on as it is); else ``send`` itself."""
    if (getattr(send, "__module__", None), getattr(send, "__qualname__", None)) != _STARLETTE_OUTERMOST:
        return send
    try:
        return send.__closure__[send.__code__.co_freevars.index("send")].cell_contents
    except (AttributeError, IndexError, TypeError, ValueError):  # laid out otherwise: keep it
        return send
