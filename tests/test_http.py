"""kvmesh/_http.py: the one token rule, the one error body, the SSE line splitter."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvmesh._http import SseLines, error_body, sse_data, token_matches


@pytest.mark.parametrize(
    ("headers", "ok"),
    [
        ([], False),
        ([(b"x-kvmesh-admin-token", b"t0k")], True),
        ([(b"X-Kvmesh-Admin-Token", b"t0k")], True),
        ([(b"authorization", b"Bearer t0k")], True),
        ([(b"authorization", b"bearer  t0k")], True),
        ([(b"authorization", b"Basic t0k")], False),
        ([(b"authorization", b"Bearer T0K")], False),
        ([(b"x-kvmesh-admin-token", b"t0k-longer")], False),
    ],
)
def test_token_rule(headers: list[tuple[bytes, bytes]], ok: bool) -> None:
    assert token_matches("t0k", headers) is ok
    assert token_matches(None, headers) is True


def test_error_body_names_the_field_with_one_vocabulary() -> None:
    assert error_body("bad", 400, "nvext.x") == {
        "error": {"message": "bad", "type": "BadRequestError", "param": "nvext.x", "code": 400}
    }
    assert error_body("gone", 503)["error"]["type"] == "ServiceUnavailableError"


@given(st.lists(st.binary(max_size=40), max_size=8), st.lists(st.integers(0, 300), max_size=10))
def test_sse_lines_reassemble_the_stream_and_never_split_a_line(parts: list[bytes], cuts: list[int]) -> None:
    stream = b"".join(p.replace(b"\r", b"") + b"\n" for p in parts)
    splitter = SseLines(max_partial=1 << 20)
    out = b""
    seen_lines: list[bytes] = []
    pos = 0
    for cut in [*sorted(set(cuts)), len(stream)]:
        before, whole, after = splitter.feed(stream[pos:cut])
        out += before + whole + after
        seen_lines += whole.splitlines()
        pos = max(pos, cut)
    before, whole, after = splitter.feed(b"", final=True)
    out += before + whole + after
    seen_lines += whole.splitlines()
    assert out == stream
    assert seen_lines == stream.splitlines()


def test_a_runaway_line_goes_out_uninterpreted() -> None:
    splitter = SseLines(max_partial=8)
    assert splitter.feed(b"data: 0123456789") == (b"", b"", b"data: 0123456789")
    assert splitter.feed(b"abc\ndata: x\n") == (b"abc\n", b"data: x\n", b"")


def test_sse_data() -> None:
    assert sse_data(b"data: {}\r\n") == b"{}"
    assert sse_data(b"data:{}") == b"{}"
    assert sse_data(b"metadata: {}") is None
