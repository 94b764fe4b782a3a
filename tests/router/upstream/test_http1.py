"""kvmesh/router/upstream/http1.py: the response parser fed every way the bytes can be cut."""

from __future__ import annotations

import pytest

from kvmesh.router.upstream.http1 import ProtocolError, ResponseParser, encode_request


class Events:
    """A ResponseSink recording what the parser reported, body bytes concatenated."""

    def __init__(self) -> None:
        self.heads: list[tuple[int, list[tuple[bytes, bytes]], bool]] = []
        self.body = b""
        self.ends = 0

    def on_head(self, status: int, headers: list[tuple[bytes, bytes]], keep_alive: bool) -> None:
        self.heads.append((status, headers, keep_alive))

    def on_body(self, data: bytes) -> None:
        assert data, "empty body pieces are never reported"
        self.body += data

    def on_end(self) -> None:
        self.ends += 1


def parse(pieces: list[bytes], *, head_request: bool = False, eof: bool = False) -> Events:
    events = Events()
    parser = ResponseParser(events)
    parser.expect(head_request=head_request)
    for piece in pieces:
        parser.feed(piece)
    if eof:
        parser.feed_eof()
    return events


def every_split(data: bytes) -> list[list[bytes]]:
    """The data whole, byte by byte, and cut in two at every position."""
    return [[data], [data[i : i + 1] for i in range(len(data))]] + [
        [data[:i], data[i:]] for i in range(1, len(data))
    ]


CHUNKED = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"d\r\ndata: first\n\n\r\n"
    b"E;ext=1\r\ndata: second\n\n\r\n"
    b"0\r\nx-trailer: yes\r\n\r\n"
)
LENGTH = b"HTTP/1.1 201 Created\r\nContent-Length: 11\r\nX-Thing:  padded \t\r\n\r\nhello world"


@pytest.mark.parametrize("pieces", every_split(CHUNKED))
def test_chunked_body_is_the_same_however_the_bytes_arrive(pieces: list[bytes]) -> None:
    events = parse(pieces)
    assert events.heads == [
        (200, [(b"content-type", b"text/event-stream"), (b"transfer-encoding", b"chunked")], True)
    ]
    assert events.body == b"data: first\n\ndata: second\n\n"
    assert events.ends == 1


@pytest.mark.parametrize("pieces", every_split(LENGTH))
def test_content_length_body_is_the_same_however_the_bytes_arrive(pieces: list[bytes]) -> None:
    events = parse(pieces)
    assert events.heads == [(201, [(b"content-length", b"11"), (b"x-thing", b"padded")], True)]
    assert events.body == b"hello world"
    assert events.ends == 1


def test_interim_responses_are_skipped_and_connection_close_is_honoured() -> None:
    events = parse(
        [b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok"]
    )
    assert [(s, k) for s, _, k in events.heads] == [(200, False)]
    assert events.body == b"ok" and events.ends == 1


def test_body_without_framing_runs_to_the_close() -> None:
    parser_events = parse([b"HTTP/1.1 200 OK\r\n\r\npart one, ", b"part two"])
    assert parser_events.ends == 0 and parser_events.heads[0][2] is False  # not reusable
    events = parse([b"HTTP/1.1 200 OK\r\n\r\npart one, ", b"part two"], eof=True)
    assert events.body == b"part one, part two" and events.ends == 1
    http10 = parse([b"HTTP/1.0 200 OK\r\nContent-Length: 1\r\n\r\nx"])
    assert http10.heads[0][2] is False and http10.ends == 1


def test_responses_without_a_body() -> None:
    assert parse([b"HTTP/1.1 204 No Content\r\n\r\n"]).ends == 1
    assert parse([b"HTTP/1.1 304 Not Modified\r\nContent-Length: 99\r\n\r\n"]).ends == 1
    head = parse([b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\n"], head_request=True)
    assert head.ends == 1 and head.body == b""
    assert parse([b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"]).ends == 1


def test_consecutive_responses_on_one_connection() -> None:
    events = Events()
    parser = ResponseParser(events)
    for body in (b"one", b"three"):
        parser.expect()
        parser.feed(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        assert parser.idle
    assert events.body == b"onethree" and events.ends == 2


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"HTTP/2 200 OK\r\n\r\n", "malformed status line"),
        (b"HTTP/1.1 2000 OK\r\n\r\n", "malformed status line"),
        (b"ICY 200 OK\r\n\r\n", "malformed status line"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "malformed response header line"),
        (b"HTTP/1.1 200 OK\r\nName : value\r\n\r\n", "malformed response header line"),
        (b"HTTP/1.1 200 OK\r\nA: b\r\n folded\r\n\r\n", "malformed response header line"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "invalid content-length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", "conflicting content-length"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "invalid chunk size"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nabc", "chunk data not followed by CRLF"),
        (b"HTTP/1.1 101 Switching Protocols\r\n\r\n", "switched protocols"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nxy", "no request outstanding"),
    ],
)
def test_malformed_responses_are_refused(data: bytes, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        parse([data])


def test_a_response_cut_short_is_an_error_at_eof() -> None:
    with pytest.raises(ProtocolError, match="closed before the response was complete"):
        parse([b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc"], eof=True)
    with pytest.raises(ProtocolError, match="larger than"):
        parse([b"HTTP/1.1 200 OK\r\n" + b"x-pad: " + b"a" * 70_000])


def test_request_encoding_and_header_injection_guard() -> None:
    data = encode_request(b"POST", b"/v1/x?a=1", b"h:1", [(b"authorization", b"Bearer k")], b"{}")
    assert data == (
        b"POST /v1/x?a=1 HTTP/1.1\r\nhost: h:1\r\nauthorization: Bearer k\r\ncontent-length: 2\r\n\r\n{}"
    )
    with pytest.raises(ValueError, match="CR or LF"):
        encode_request(b"GET", b"/", b"h", [(b"x-a", b"v\r\nx-injected: 1")], b"")
    with pytest.raises(ValueError, match="CR or LF"):
        encode_request(b"GET", b"/\n", b"h", [], b"")
