"""HTTP details every side of kvmesh speaks the same way: the router, the worker RPCs, the mock.

One of each, so they cannot drift apart:

* :func:`error_body`: the OpenAI-style error object, with one vocabulary of ``type`` names (the
  exception class names OpenAI clients raise for each status, as vLLM answers them);
* :func:`token_matches`: the one token rule, ``x-kvmesh-admin-token: T`` or
  ``Authorization: Bearer T``, compared in constant time;
* :func:`wait_disconnect` and :func:`replay_body`: the ASGI ``receive`` side of a request whose
  body was already read (who else reads ``receive`` after the body? only the disconnect watch);
* :class:`SseLines`: server-sent events split into whole lines across reads, so callers match on
  a line's structure (``data: `` at its start) and never on a substring of a body;
* :func:`header_safe`: whether a client's or an operator's text can travel as a header value;
* :class:`MethodNotAllowed`: the 405 of a kvmesh path asked with another method, as JSON;
* :func:`route_path`: the path an app routes on, below the server's ``root_path``.

Standard library only: a leaf (tests/test_layering.py).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

ADMIN_TOKEN_HEADER = b"x-kvmesh-admin-token"
HEADER_SAFE_RULE = "printable ASCII, not beginning or ending with a space"
"""What :func:`header_safe` accepts, in words for an error message."""

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    409: "ConflictError",
    413: "BadRequestError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    502: "UpstreamError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def error_type(status: int) -> str:
    return _ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")


def error_body(message: str, status: int, field: str | None = None) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}``: ``param`` names the offending field."""
    return {"error": {"message": message, "type": error_type(status), "param": field, "code": status}}


def token_matches(token: str | None, headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """True when no token is configured, or the request carries it in either accepted header."""
    if not token:
        return True
    expected = token.encode()
    for name, value in headers:
        name = name.lower()
        if name == ADMIN_TOKEN_HEADER and hmac.compare_digest(value.strip(), expected):
            return True
        if name == b"authorization":
            # The scheme is case-insensitive (RFC 9110 §11.1); the token is not.
            scheme, _, given = value.strip().partition(b" ")
            if scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), expected):
                return True
    return False


Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]


async def wait_disconnect(receive: Receive) -> None:
    """Return when the client has gone (``http.disconnect``); the body must already be read."""
    while (await receive())["type"] != "http.disconnect":
        pass


def replay_body(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that yields ``body`` once, then the client's own messages (its disconnect)."""
    delivered = False

    async def replaying_receive() -> MutableMapping[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replaying_receive


class SseLines:
    """Whole lines of a server-sent event stream, however the bytes were cut into reads.

    ``feed`` returns ``(before, lines, after)``: ``lines`` are the bytes of complete lines to
    interpret (split them with ``bytes.splitlines``, which knows SSE's line terminators);
    ``before`` and ``after`` are bytes to pass on uninterpreted around them. An unfinished last
    line waits for the next read, unless it grows past ``max_partial``: then it goes out
    uninterpreted (``after``), and so does the rest of it when it comes (``before``)."""

    __slots__ = ("_max_partial", "_midline", "_partial")

    def __init__(self, max_partial: int = 64 * 1024) -> None:
        self._partial = b""
        self._max_partial = max_partial
        self._midline = False

    @property
    def waiting(self) -> bool:
        """Part of a line is held back, or the rest of a line passed on uninterpreted is due: the
        next bytes do not start a line."""
        return bool(self._partial) or self._midline

    def feed(self, chunk: bytes, *, final: bool = False) -> tuple[bytes, bytes, bytes]:
        data = self._partial + chunk if self._partial else chunk
        self._partial = b""
        before = b""
        if self._midline:  # the rest of a line already passed on uninterpreted
            end = data.find(b"\n") + 1
            if end == 0:
                self._midline = not final
                return data, b"", b""
            before, data, self._midline = data[:end], data[end:], False
        if final:
            return before, data, b""
        cut = data.rfind(b"\n") + 1
        lines, rest = data[:cut], data[cut:]
        if len(rest) > self._max_partial:
            self._midline = True
            return before, lines, rest
        self._partial = rest
        return before, lines, b""


def sse_data(line: bytes) -> bytes | None:
    """The payload of a ``data:`` line (its terminator stripped, one optional space after the
    colon dropped), else None."""
    if not line.startswith(b"data:"):
        return None
    payload = line[5:].rstrip(b"\r\n")
    return payload[1:] if payload.startswith(b" ") else payload


def header_safe(text: str) -> bool:
    """Whether ``text`` travels as an HTTP header value unchanged: visible ASCII with inner spaces
    (:data:`HEADER_SAFE_RULE`). A control character makes the receiving server refuse the whole
    request, CR or LF would start a header of the sender's choosing (kvmesh's HTTP client refuses
    both, and the request failed with a 500), an edge space is dropped by the receiver's parser, and
    text beyond Latin-1 cannot be written at all."""
    # (for ASCII, ``isprintable`` is exactly space to tilde)
    return bool(text) and text[0] != " " and text[-1] != " " and text.isascii() and text.isprintable()


def route_path(scope: MutableMapping[str, Any]) -> str:
    """The request's path below the ``root_path`` the app is served under, as Starlette routes.

    ``vllm serve --root-path /llm`` and SGLang's ``--fastapi-root-path`` set it, and uvicorn given
    one puts it before every path: ``/v1/chat/completions`` arrives as ``/llm/v1/chat/completions``.
    Matched on the whole path, no request was routed and the router's own admin API
    (``/kvmesh/workers``, ``/kvmesh/router``) answered 404."""
    path: str = scope["path"]
    root: str = (scope.get("root_path") or "").rstrip("/")
    if root and path.startswith(root) and path[len(root) : len(root) + 1] in ("", "/"):
        return path[len(root) :] or "/"
    return path


class MethodNotAllowed:
    """An ASGI app that answers any request with an OpenAI 405 naming the methods served, also in
    ``allow``. Routed after a path's own routes, it takes only the other methods: Starlette's own
    405 is plain text, where every other refusal of kvmesh's is an OpenAI error."""

    __slots__ = ("allowed",)

    def __init__(self, allowed: str) -> None:
        self.allowed = allowed

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        message = f"{scope['method']} is not served at {scope['path']}; use {self.allowed}"
        body = json.dumps(error_body(message, 405)).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(body)),
            (b"allow", self.allowed.encode()),
        ]
        await send({"type": "http.response.start", "status": 405, "headers": headers})
        await send({"type": "http.response.body", "body": body})
