"""kvmesh/router/request/nvext.py: every field validated, every error names its field."""

from __future__ import annotations

import pytest

from kvmesh.errors import NvextError
from kvmesh.router.request.nvext import EMPTY, parse_nvext, parse_ttl, strip_nvext


def test_absent_nvext_is_the_shared_empty_value() -> None:
    assert parse_nvext({"messages": []}) is EMPTY
    assert parse_nvext({"messages": []}, {}) is EMPTY


def test_full_nvext() -> None:
    nv = parse_nvext(
        {
            "nvext": {
                "backend_instance_id": "w1",
                "extra_fields": ["worker_id", "timing"],
                "agent_hints": {
                    "priority": 3,
                    "latency_sensitivity": 1.5,
                    "osl": 128,
                    "speculative_prefill": True,
                    "kv_overlap_score_credit": 0.5,
                },
                "session_control": {"session_id": "s1", "action": "open", "timeout": 60},
                "cache_control": {"type": "ephemeral", "ttl": "1h"},
                "ignore_eos": True,  # a sampling knob the engine takes under the same name
            }
        }
    )
    assert nv.pinned_worker == "w1"
    assert nv.want_worker_id and nv.want_timing
    assert (nv.hints.priority, nv.hints.latency_sensitivity, nv.hints.osl) == (3, 1.5, 128)
    assert nv.hints.speculative_prefill is True
    assert nv.hints.kv_overlap_score_credit == 0.5
    assert nv.session is not None
    assert (nv.session.session_id, nv.session.action, nv.session.timeout) == ("s1", "open", 60.0)
    assert nv.cache_ttl == 3600.0
    assert nv.sampling == (("ignore_eos", True),)


def test_headers_override_the_body() -> None:
    nv = parse_nvext(
        {"nvext": {"backend_instance_id": "w1", "prefill_worker_id": "p1"}},
        {"x-worker-instance-id": "w2", "x-prefill-instance-id": "p2"},
    )
    assert (nv.backend_instance_id, nv.prefill_worker_id) == ("w2", "p2")
    assert parse_nvext({}, {"x-worker-instance-id": " w3 "}).pinned_worker == "w3"


def test_integer_worker_ids_are_accepted_as_strings() -> None:
    assert parse_nvext({"nvext": {"decode_worker_id": 7}}).pinned_worker == "7"


@pytest.mark.parametrize(
    ("nvext", "field"),
    [
        pytest.param([], "nvext", id="not-object"),
        pytest.param({"backend_instance_id": 1.5}, "nvext.backend_instance_id", id="float-id"),
        pytest.param({"backend_instance_id": ""}, "nvext.backend_instance_id", id="empty-id"),
        pytest.param({"extra_fields": "worker_id"}, "nvext.extra_fields", id="extra-not-list"),
        pytest.param({"extra_fields": ["bogus"]}, "nvext.extra_fields", id="extra-unknown"),
        pytest.param({"agent_hints": 3}, "nvext.agent_hints", id="hints-not-object"),
        pytest.param({"agent_hints": {"priority": "high"}}, "nvext.agent_hints.priority", id="priority-str"),
        pytest.param({"agent_hints": {"priority": True}}, "nvext.agent_hints.priority", id="priority-bool"),
        pytest.param({"agent_hints": {"osl": 0}}, "nvext.agent_hints.osl", id="osl-zero"),
        pytest.param(
            {"agent_hints": {"latency_sensitivity": -1}},
            "nvext.agent_hints.latency_sensitivity",
            id="sensitivity",
        ),
        pytest.param(
            {"agent_hints": {"kv_overlap_score_credit": 1.5}},
            "nvext.agent_hints.kv_overlap_score_credit",
            id="credit",
        ),
        pytest.param(
            {"agent_hints": {"speculative_prefill": "yes"}},
            "nvext.agent_hints.speculative_prefill",
            id="spec",
        ),
        pytest.param(
            {"session_control": {"action": "open"}}, "nvext.session_control.session_id", id="no-session"
        ),
        *(
            pytest.param(
                {"session_control": {"session_id": sid}}, "nvext.session_control.session_id", id=name
            )
            for name, sid in (
                ("session-id-crlf", "a\r\nx-evil: 1"),
                ("session-id-control", "\x1f"),
                ("session-id-edge-space", " s"),
                ("session-id-beyond-latin1", "\u65e5\u672c"),
                ("session-id-latin1", "caf\u00e9"),
            )
        ),
        pytest.param(
            {"session_control": {"session_id": "s", "action": "pause"}},
            "nvext.session_control.action",
            id="action",
        ),
        pytest.param(
            {"session_control": {"session_id": "s", "timeout": 0}},
            "nvext.session_control.timeout",
            id="timeout",
        ),
        pytest.param({"cache_control": {"type": "persistent"}}, "nvext.cache_control.type", id="cache-type"),
        pytest.param({"cache_control": {"ttl": "soon"}}, "nvext.cache_control.ttl", id="cache-ttl"),
    ],
)
def test_invalid_fields_are_named(nvext: object, field: str) -> None:
    with pytest.raises(NvextError) as info:
        parse_nvext({"nvext": nvext})
    assert info.value.field == field
    assert field in str(info.value)
    assert info.value.status == 400


@pytest.mark.parametrize("sid", ["conv 7", "a-b_c.d:1/2~", "x" * 256])
def test_a_session_id_a_header_carries_is_kept_as_it_is(sid: str) -> None:
    nv = parse_nvext({"nvext": {"session_control": {"session_id": sid}}})
    assert nv.session is not None and nv.session.session_id == sid


def test_empty_override_header_is_refused() -> None:
    with pytest.raises(NvextError, match="header x-worker-instance-id must not be empty"):
        parse_nvext({}, {"x-worker-instance-id": "  "})


@pytest.mark.parametrize(
    ("ttl", "seconds"),
    [("600", 600.0), ("5m", 300.0), ("1h", 3600.0), ("30s", 30.0), (90, 90.0), ("2.5m", 150.0)],
)
def test_ttl_forms(ttl: object, seconds: float) -> None:
    assert parse_ttl(ttl, "ttl") == seconds


@pytest.mark.parametrize(("ttl", "clamped"), [("1m", 300.0), ("5h", 3600.0), ("900", 900.0)])
def test_cache_ttl_is_clamped(ttl: str, clamped: float) -> None:
    assert parse_nvext({"nvext": {"cache_control": {"type": "ephemeral", "ttl": ttl}}}).cache_ttl == clamped


def test_strip_nvext_copies_only_when_needed() -> None:
    body = {"model": "m"}
    assert strip_nvext(body) is body
    assert strip_nvext({"model": "m", "nvext": {}}) == {"model": "m"}
