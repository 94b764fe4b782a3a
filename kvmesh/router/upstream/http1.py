"""HTTP/1.1 client wire format, without I/O: request heads out, responses parsed incrementally.

:class:`ResponseParser` turns the bytes of one connection into ``on_head`` / ``on_body`` /
``on_end`` calls on a sink, one response per request (no pipelining). Bodies are framed by
``Content-Length``, ``Transfer-Encoding: chunked`` or the end of the connection (RFC 9112
section 6.3); interim ``1xx`` heads are skipped. Body bytes are handed on as they arrive, never
buffered until the end, so a server-sent event stream stays event by event.
"""

from __future__ import annotations

import re
from typing import Protocol

MAX_HEAD_BYTES = 64 * 1024
_MAX_CHUNK_LINE = 4096
_HEX = re.compile(rb"[0-9A-Fa-f]{1,15}")
_DIGITS = re.compile(rb"[0-9]{1,18}")
_STATUS_LINE = re.compile(rb"HTTP/1\.([01]) ([0-9]{3})(?: |\Z)")

# Parser states.
_IDLE, _HEAD, _LENGTH, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_END, _TRAILERS, _UNTIL_CLOSE = range(8)


class ProtocolError(Exception):
    """The peer sent something that is not a valid HTTP/1.1 response."""


class ResponseSink(Protocol):
    def on_head(self, status: int, headers: list[tuple[bytes, bytes]], keep_alive: bool) -> None: ...
    def on_body(self, data: bytes) -> None: ...
    def on_end(self) -> None: ...


def encode_request(
    method: bytes, target: bytes, host: bytes, headers: list[tuple[bytes, bytes]], body: bytes
) -> bytes:
    """Request line, ``Host``, the given headers, ``Content-Length`` and the body, as one buffer.

    ``headers`` must not carry Host, Content-Length or Transfer-Encoding (the caller filters them).
    ValueError if a name or value would break the framing (a CR or LF inside it).
    """
    lines = [method, b" ", target, b" HTTP/1.1\r\nhost: ", host, b"\r\n"]
    for name, value in headers:
        lines += (name, b": ", value, b"\r\n")
    lines += (b"content-length: ", b"%d" % len(body), b"\r\n\r\n")
    head = b"".join(lines)
    # One CRLF per header line, plus the request line, Host, Content-Length and the blank line:
    # a stray CR or LF anywhere in a name, value or target shows up as an extra one.
    expected = len(headers) + 4
    if head.count(b"\n") != expected or head.count(b"\r") != expected:
        raise ValueError("a request header or target contains CR or LF")
    return head + body if body else head


class ResponseParser:
    """Parse the responses of one client connection; call :meth:`expect` before each one."""

    __slots__ = ("_buf", "_head_request", "_remaining", "_sink", "_state")

    def __init__(self, sink: ResponseSink) -> None:
        self._sink = sink
        self._state = _IDLE
        self._buf = b""
        self._remaining = 0
        self._head_request = False

    @property
    def idle(self) -> bool:
        """No response is expected or in progress (the last one is complete)."""
        return self._state == _IDLE

    def expect(self, *, head_request: bool = False) -> None:
        """A request went out: the next bytes are its response."""
        if self._state != _IDLE:
            raise ProtocolError("a response is still in progress on this connection")
        self._state = _HEAD
        self._head_request = head_request

    def feed(self, data: bytes) -> None:
        """Consume bytes from the connection; ProtocolError when they are not a valid response."""
        if self._buf:
            data = self._buf + data
            self._buf = b""
        while data:
            state = self._state
            if state in (_LENGTH, _CHUNK_DATA):
                remaining = self._remaining
                if len(data) <= remaining:
                    self._remaining = remaining - len(data)
                    self._sink.on_body(data)
                    data = b""
                else:
                    self._remaining = 0
                    self._sink.on_body(data[:remaining])
                    data = data[remaining:]
                if self._remaining == 0:
                    if state == _LENGTH:
                        self._end()
                    else:
                        self._state = _CHUNK_END
            elif state == _HEAD:
                data = self._head(data)
            elif state == _UNTIL_CLOSE:
                self._sink.on_body(data)
                data = b""
            elif state == _IDLE:
                raise ProtocolError("bytes arrived with no request outstanding")
            else:
                data = self._chunked(data)

    def feed_eof(self) -> None:
        """The peer closed its side; ProtocolError if that cuts a response short."""
        if self._state == _UNTIL_CLOSE:
            self._end()
        elif self._state != _IDLE:
            raise ProtocolError("connection closed before the response was complete")

    # ---------------------------------------------------------------- head
    def _head(self, data: bytes) -> bytes:
        end = data.find(b"\r\n\r\n")
        if end < 0:
            if len(data) > MAX_HEAD_BYTES:
                raise ProtocolError(f"response head larger than {MAX_HEAD_BYTES} bytes")
            self._buf = data
            return b""
        lines = data[:end].split(b"\r\n")
        status, version_minor = _status_line(lines[0])
        if 100 <= status < 200:
            if status == 101:
                raise ProtocolError("the worker switched protocols (101), which is not supported")
            return data[end + 4 :]  # an interim response: the real head follows
        headers: list[tuple[bytes, bytes]] = []
        chunked = until_close = False
        length: bytes | None = None
        keep_alive = version_minor == 1
        for line in lines[1:]:
            name, colon, value = line.partition(b":")
            if not colon or not name or name[-1] in b" \t" or line[0] in b" \t":
                raise ProtocolError(f"malformed response header line {line[:100]!r}")
            name = name.lower()
            value = value.strip(b" \t")
            headers.append((name, value))
            if name == b"content-length":
                if length is not None and value != length:
                    raise ProtocolError("conflicting content-length headers")
                length = value
            elif name == b"transfer-encoding":
                # Only a final "chunked" frames the body; any other coding runs to the close.
                chunked = value.lower().rsplit(b",", 1)[-1].strip() == b"chunked"
                until_close = not chunked
            elif name == b"connection" and b"close" in value.lower():
                keep_alive = False
        no_body = self._head_request or status == 204 or status == 304
        if not no_body and not chunked and (until_close or length is None):
            keep_alive = False
        self._sink.on_head(status, headers, keep_alive)
        rest = data[end + 4 :]
        if no_body:
            self._end()
        elif chunked:
            self._state = _CHUNK_SIZE
        elif until_close or length is None:
            self._state = _UNTIL_CLOSE
        else:
            if _DIGITS.fullmatch(length) is None:
                raise ProtocolError(f"invalid content-length {length[:40]!r}")
            self._remaining = int(length)
            if self._remaining == 0:
                self._end()
            else:
                self._state = _LENGTH
        return rest

    # ---------------------------------------------------------------- chunked
    def _chunked(self, data: bytes) -> bytes:
        state = self._state
        if state == _CHUNK_END:
            if len(data) < 2:
                self._buf = data
                return b""
            if data[:2] != b"\r\n":
                raise ProtocolError("chunk data not followed by CRLF")
            self._state = _CHUNK_SIZE
            return data[2:]
        end = data.find(b"\r\n")
        if end < 0:
            if len(data) > _MAX_CHUNK_LINE:
                raise ProtocolError("chunk size or trailer line too long")
            self._buf = data
            return b""
        line = data[:end]
        if state == _CHUNK_SIZE:
            size = line.split(b";", 1)[0].strip(b" \t")
            if _HEX.fullmatch(size) is None:
                raise ProtocolError(f"invalid chunk size {line[:40]!r}")
            self._remaining = int(size, 16)
            self._state = _CHUNK_DATA if self._remaining else _TRAILERS
        elif not line:  # _TRAILERS: the blank line ends the message
            self._end()
        return data[end + 2 :]

    def _end(self) -> None:
        self._state = _IDLE
        self._sink.on_end()


def _status_line(line: bytes) -> tuple[int, int]:
    """``HTTP/1.x NNN reason`` -> (status, x)."""
    match = _STATUS_LINE.match(line)
    if match is None:
        raise ProtocolError(f"malformed status line {line[:100]!r}")
    return int(match[2]), line[7] - 0x30
