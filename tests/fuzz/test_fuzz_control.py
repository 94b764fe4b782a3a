"""Fuzz the control surfaces over real loopback HTTP, standalone and embedded: the router's admin API
(``POST`` and ``DELETE /kvmesh/workers``, ``POST /busy_threshold``, ``GET /kvmesh/decisions``, every
standard method on its paths, ``GET /v1/responses/{id}``) and each engine's worker RPCs (``/kvmesh/session_control``,
``/kvmesh/pin_prefix``, every standard method on their paths). Whatever the body, kvmesh answers no
5xx, every 400 is an OpenAI error that names the field, every other 4xx an OpenAI error with a
message; afterwards, with the workers a case added removed and the thresholds put back, the router
serves a chat on its own fleet and nothing runs on the engines.

``make test`` runs a bounded number of cases; ``make fuzz`` as many as the generation fuzz."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.harness import FUZZ, Target, check_answer, reported
from tests.fuzz.strategies import IDS, MODEL, PIN_RPC, SESSION_RPC, THRESHOLDS, WORKER_SPEC, raw_body

METHODS = st.sampled_from(["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE"])
NAMED = {400, 413, 422}
"""Refusals of a client's input: these name the field."""


def _admin_case(kind: str) -> st.SearchStrategy[tuple[str, str, bytes]]:
    """(method, path, body) of one admin call."""
    if kind == "add-worker":
        return raw_body(WORKER_SPEC).map(lambda b: ("POST", "/kvmesh/workers", b))
    if kind == "remove-worker":
        return IDS.map(lambda i: ("DELETE", "/kvmesh/workers/" + quote(i, safe=""), b""))
    if kind == "thresholds":
        return raw_body(THRESHOLDS).map(lambda b: ("POST", "/busy_threshold", b))
    if kind == "methods":  # (any method on any admin path, with a worker id or not)
        paths = st.one_of(
            st.sampled_from(["/kvmesh/workers", "/kvmesh/router", "/kvmesh/decisions", "/busy_threshold"]),
            IDS.map(lambda i: "/kvmesh/workers/" + quote(i, safe="")),
        )
        return st.tuples(METHODS, paths, st.just(b"{}"))
    if kind == "stored-responses":  # (a stored response asked for again, by any id)
        ids = IDS.filter(lambda i: "/" not in i and i.strip())
        return ids.map(lambda i: ("GET", "/v1/responses/" + quote(i, safe=""), b""))
    assert kind == "decisions"
    limits = st.one_of(st.integers(-5, 10**6).map(str), st.text(max_size=12))
    return limits.map(lambda v: ("GET", "/kvmesh/decisions?limit=" + quote(v, safe=""), b""))


@pytest.mark.parametrize(
    "kind", ["add-worker", "remove-worker", "thresholds", "decisions", "methods", "stored-responses"]
)
def test_admin_api_answers_no_5xx_and_names_the_field(target: Target, kind: str) -> None:
    workers_before = _worker_ids(target)
    thresholds_before = target.get_json("/busy_threshold")["thresholds"][0]

    @FUZZ
    @given(call=_admin_case(kind))
    def case(call: tuple[str, str, bytes]) -> None:
        method, path, body = call
        status, data = target.call(method, path, body)
        check_answer(status, data, f"{method} {path} {body!r}", NAMED)

    with reported(target, f"admin {kind}"):
        case()
        for worker_id in _worker_ids(target) - workers_before:  # (what the cases added)
            status, _ = target.call("DELETE", "/kvmesh/workers/" + quote(worker_id, safe=""))
            assert status == 200, worker_id
        assert _worker_ids(target) == workers_before  # (no case removed one of the fleet's)
        status, data = target.post("/busy_threshold", json.dumps(thresholds_before).encode(), {})
        assert status == 200, data
        _serves_a_chat(target)


@pytest.mark.parametrize(
    ("path", "doc"),
    [("/kvmesh/session_control", SESSION_RPC), ("/kvmesh/pin_prefix", PIN_RPC)],
    ids=["session_control", "pin_prefix"],
)
def test_worker_rpcs_answer_no_5xx_and_name_the_field(target: Target, path: str, doc: Any) -> None:
    @FUZZ
    @given(body=raw_body(doc), engine=st.sampled_from(target.engine_urls))
    def case(body: bytes, engine: str) -> None:
        status, data = target.call("POST", path, body, url=engine)
        check_answer(status, data, f"{path} {body!r}", NAMED)

    with reported(target, f"rpc {path}"):
        case()
        _serves_a_chat(target)


RPC_PATHS = ["/kvmesh/info", "/kvmesh/kv_state", "/kvmesh/pin_prefix", "/kvmesh/session_control"]


def test_worker_rpc_paths_answer_any_method_with_no_5xx(target: Target) -> None:
    @FUZZ
    @given(method=METHODS, path=st.sampled_from(RPC_PATHS), engine=st.sampled_from(target.engine_urls))
    def case(method: str, path: str, engine: str) -> None:
        status, data = target.call(method, path, b"{}", url=engine)
        check_answer(status, data, f"{method} {path}", NAMED)

    with reported(target, "rpc methods"):
        case()
        _serves_a_chat(target)


def _worker_ids(t: Target) -> set[str]:
    return {row["worker_id"] for row in t.get_json("/kvmesh/workers")["workers"]}


def _serves_a_chat(t: Target) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "still there?"}], "max_tokens": 2}
    status, data = t.post("/v1/chat/completions", json.dumps(body).encode(), {})
    assert status == 200, data
    t.settled()
