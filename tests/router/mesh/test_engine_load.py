"""kvmesh/router/mesh/engine_load.py: the engine's own running / waiting counts from its /metrics page."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.router.mesh.engine_load import EngineLoad, parse_engine_load

VLLM = b"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:num_requests_waiting_by_reason{reason="capacity"} 99.0
vllm:num_requests_running_total 77.0
"""

SGLANG = b"""# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="unified",model_name="m {odd}",tp_rank="0"} 7.0
sglang:num_queue_reqs{engine_type="unified",model_name="m",tp_rank="0"} 1.0 1700000000000
sglang:num_running_reqs_offline_batch{model_name="m"} 50.0
"""


SGLANG_DP = b"""# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{dp_rank="0",engine_type="unified",model_name="m",priority="1",tp_rank="0"} 2.0
sglang:num_running_reqs{dp_rank="0",engine_type="unified",model_name="m",priority="5",tp_rank="0"} 1.0
sglang:num_running_reqs{dp_rank="0",engine_type="unified",model_name="m",priority="1",tp_rank="1"} 2.0
sglang:num_running_reqs{dp_rank="0",engine_type="unified",model_name="m",priority="5",tp_rank="1"} 1.0
sglang:num_running_reqs{dp_rank="1",engine_type="unified",model_name="m \\\"x\\\"",priority="1",tp_rank="2"} 4.0
sglang:num_queue_reqs{dp_rank="1",engine_type="unified",model_name="m",priority="1",tp_rank="2"} 6.0
sglang:num_queue_reqs{dp_rank="1",engine_type="unified",model_name="m",priority="1",tp_rank="3"} 6.0
"""


def test_vllm_names_are_summed_over_their_label_sets_and_look_alikes_ignored() -> None:
    assert parse_engine_load(VLLM, 1.0) == EngineLoad(
        running=5.0, waiting=4.0, at=1.0, ranks={0: (3.0, 4.0), 1: (2.0, 0.0)}
    )


def test_sglang_dp_ranks_apart_priorities_summed_and_a_queue_its_tp_ranks_repeat_counted_once() -> None:
    # every TP rank of a scheduler reports its queue with --enable-metrics-for-all-schedulers
    assert parse_engine_load(SGLANG_DP, 3.0) == EngineLoad(
        running=7.0, waiting=6.0, at=3.0, ranks={0: (3.0, 0.0), 1: (4.0, 6.0)}
    )


def test_ranks_only_when_every_series_names_a_rank() -> None:
    mixed = b'vllm:num_requests_running{engine="0"} 1.0\nvllm:num_requests_running 2.0\n'
    assert parse_engine_load(mixed, 0.0) == EngineLoad(running=3.0, waiting=0.0, at=0.0)
    odd = b'vllm:num_requests_waiting{engine="core-a"} 2.0\n'
    assert parse_engine_load(odd, 0.0) == EngineLoad(running=0.0, waiting=2.0, at=0.0)


def test_sglang_names_with_timestamps_and_braces_inside_label_values() -> None:
    assert parse_engine_load(SGLANG, 2.0) == EngineLoad(running=7.0, waiting=1.0, at=2.0)


def test_a_page_without_the_gauges_is_none() -> None:
    assert (
        parse_engine_load(b"# nothing\nprocess_cpu_seconds_total 1.0\nvllm:num_requests_running NaN\n", 0)
        is None
    )
    assert parse_engine_load(b"", 0) is None


_NAME = st.sampled_from(
    [b"vllm:num_requests_running", b"vllm:num_requests_waiting", b"sglang:num_queue_reqs"]
)
_LABELS = st.lists(
    st.tuples(
        st.sampled_from([b"engine", b"dp_rank", b"tp_rank", b"model_name", b"x"]),
        st.binary(max_size=8) | st.sampled_from([b"0", b"1", b"12", b"-1", b"99999999"]),
    ),
    max_size=4,
)


@st.composite
def _pages(draw: st.DrawFn) -> bytes:
    """Pages that mix well-formed series with mangled ones: truncated label sections, stray
    quotes and backslashes, bad values."""
    lines = []
    for _ in range(draw(st.integers(0, 8))):
        name = draw(_NAME)
        pairs = b",".join(k + b'="' + v.replace(b"\n", b"") + b'"' for k, v in draw(_LABELS))
        value = draw(
            st.sampled_from([b"1.0", b"0", b"NaN", b"+Inf", b"-2", b"1e308", b"x", b"", b"3 1700000000000"])
        )
        line = name + (b"{" + pairs + b"}" if pairs or draw(st.booleans()) else b"") + b" " + value
        cut = draw(st.integers(0, len(line)))
        lines.append(line if draw(st.booleans()) else line[:cut] + draw(st.binary(max_size=6)))
    return b"\n".join(lines)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(_pages())
def test_any_page_parses_to_finite_counts_or_none_and_never_raises(page: bytes) -> None:
    load = parse_engine_load(page, 0.0)
    if load is None:
        return
    assert 0 <= load.running < 1e10 and 0 <= load.waiting < 1e10
    if load.ranks is not None:
        assert all(r >= 0 for r in load.ranks)
        assert sum(run for run, _ in load.ranks.values()) == pytest.approx(load.running)
        assert sum(wait for _, wait in load.ranks.values()) == pytest.approx(load.waiting)
