"""kvmesh/router/mesh/engine_load.py: the engine's own running / waiting counts from its /metrics page."""

from __future__ import annotations

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
