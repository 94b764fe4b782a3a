"""RouterConfig: one flag table behind argparse, env vars and the [router] table."""

from __future__ import annotations

import argparse

import pytest

from kvmesh.errors import ConfigError
from kvmesh.router.core.config import RouterConfig


def parse(*argv: str) -> RouterConfig:
    p = argparse.ArgumentParser()
    RouterConfig.add_arguments(p)
    return RouterConfig.from_namespace(p.parse_args(list(argv)))


def test_defaults_mirror_the_reference() -> None:
    c = RouterConfig()
    assert (c.overlap_score_credit, c.prefill_load_scale, c.router_temperature) == (1.0, 1.0, 0.0)
    assert (c.host_cache_hit_weight, c.disk_cache_hit_weight) == (0.75, 0.25)
    assert (c.router_ttl_secs, c.router_max_tree_size, c.router_prune_target_ratio) == (120.0, 2**20, 0.8)
    assert c.use_kv_events and c.router_assume_kv_reuse and c.router_track_active_blocks
    assert parse() == c


def test_flags() -> None:
    c = parse(
        "--router-temperature",
        "0.5",
        "--no-router-kv-events",
        "--router-queue-policy",
        "wspt",
        "--active-decode-blocks-threshold",
        "0.9",
    )
    assert (c.router_temperature, c.use_kv_events, c.router_queue_policy) == (0.5, False, "wspt")
    assert c.active_decode_blocks_threshold == 0.9
    # what still applies to round-robin: the busy thresholds, the queue, the load model
    rr = parse(
        "--router-mode",
        "round_robin",
        "--router-queue-policy",
        "wspt",
        "--active-decode-blocks-threshold",
        "0.9",
    )
    assert (rr.router_mode, rr.router_queue_policy, rr.active_decode_blocks_threshold) == (
        "round-robin",
        "wspt",
        0.9,
    )
    # predict-on-route sits beside KV events; without them it is refused (it would change nothing)
    assert parse("--router-predicted-ttl-secs", "5").router_predicted_ttl_secs == 5.0
    assert parse("--router-queue-threshold", "none").router_queue_threshold is None


def test_deprecated_overlap_score_weight_maps_to_prefill_load_scale() -> None:
    c = parse("--router-kv-overlap-score-weight", "2")
    assert (c.prefill_load_scale, c.overlap_score_credit) == (2.0, 1.0)
    c = parse("--kv-overlap-score-weight", "0")
    assert (c.prefill_load_scale, c.overlap_score_credit) == (0.0, 0.0)
    c = RouterConfig.from_env({"KVMESH_ROUTER_KV_OVERLAP_SCORE_WEIGHT": "0"})
    assert c.overlap_score_credit == 0.0


def test_the_deprecated_weight_beside_what_it_sets_must_agree() -> None:
    # given with the flag it sets, one of the two would be dropped without a word
    with pytest.raises(
        ConfigError, match="--router-kv-overlap-score-weight 2 sets --router-prefill-load-scale"
    ):
        parse("--router-kv-overlap-score-weight", "2", "--router-prefill-load-scale", "3")
    with pytest.raises(ConfigError, match="contradicts --router-kv-overlap-score-credit 1"):
        parse("--router-kv-overlap-score-weight", "0", "--router-kv-overlap-score-credit", "1")
    assert (
        parse("--router-kv-overlap-score-weight", "2", "--router-prefill-load-scale", "2").prefill_load_scale
        == 2
    )
    with pytest.raises(
        ConfigError, match="KVMESH_ROUTER_KV_OVERLAP_SCORE_WEIGHT 2 sets KVMESH_ROUTER_PREFILL_LOAD_SCALE"
    ):
        RouterConfig.from_env(
            {"KVMESH_ROUTER_KV_OVERLAP_SCORE_WEIGHT": "2", "KVMESH_ROUTER_PREFILL_LOAD_SCALE": "3"}
        )


@pytest.mark.parametrize("flag", ["--router-prefill-load-scale", "--router-kv-overlap-score-weight"])
def test_a_prefill_weight_past_what_the_cost_can_price_is_refused(flag: str) -> None:
    # 1e308 made every latency-cost term infinite, and every request a 500
    with pytest.raises(ConfigError, match=f"{flag} must be in \\[0, 1000000\\]"):
        parse(flag, "1e308")
    assert parse(flag, "1e6").prefill_load_scale == 1e6


def test_a_bad_value_is_named_as_it_was_given() -> None:
    with pytest.raises(ConfigError, match=r"^KVMESH_ROUTER_COST_MODEL must be one of"):
        RouterConfig.from_env({"KVMESH_ROUTER_COST_MODEL": "foo"})
    with pytest.raises(ConfigError, match=r"^KVMESH_ROUTER_TEMPERATURE must be >= 0"):
        RouterConfig.from_env({"KVMESH_ROUTER_TEMPERATURE": "-1"})
    with pytest.raises(ConfigError, match=r"^\[router\] router_temperature must be >= 0"):
        RouterConfig.from_mapping({"temperature": -1})
    with pytest.raises(ConfigError, match=r"^--router-temperature must be >= 0"):
        parse("--router-temperature", "-1")


def test_env_vars() -> None:
    c = RouterConfig.from_env(
        {
            "KVMESH_ROUTER_TEMPERATURE": "1.5",
            "KVMESH_ROUTER_KV_EVENTS": "false",
            "KVMESH_ROUTER_ACTIVE_PREFILL_TOKENS_THRESHOLD": "4096",
            "KVMESH_ROUTER_KV_OVERLAP_SCORE_CREDIT": "0.25",
            "UNRELATED": "x",
        }
    )
    assert (c.router_temperature, c.use_kv_events) == (1.5, False)
    assert (c.active_prefill_tokens_threshold, c.overlap_score_credit) == (4096, 0.25)


def test_mapping_accepts_field_and_flag_names_and_refuses_unknown_keys() -> None:
    c = RouterConfig.from_mapping({"router_temperature": 0.5, "queue-policy": "lcfs", "ttl_secs": 30})
    assert (c.router_temperature, c.router_queue_policy, c.router_ttl_secs) == (0.5, "lcfs", 30.0)
    with pytest.raises(ConfigError, match="unknown router setting 'tempreature'"):
        RouterConfig.from_mapping({"tempreature": 1})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"overlap_score_credit": 1.5}, r"--router-kv-overlap-score-credit must be in \[0, 1\], got 1.5"),
        ({"router_temperature": -1.0}, "--router-temperature must be >= 0, got -1.0"),
        ({"router_prune_target_ratio": 0.0}, r"--router-prune-target-ratio must be in \(0, 1\], got 0.0"),
        ({"router_ttl_secs": 0.0}, "--router-ttl-secs must be > 0, got 0.0"),
        ({"router_queue_policy": "sjf"}, "--router-queue-policy must be one of fcfs, lcfs, wspt, got 'sjf'"),
        ({"router_mode": "best"}, "--router-mode must be one of kv, round-robin, random, direct"),
        ({"router_max_tree_size": 0}, "--router-max-tree-size must be >= 1, got 0"),
    ],
)
def test_validation_names_the_flag_and_range(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RouterConfig(**kwargs)


def test_unparseable_values_name_the_variable_they_came_from() -> None:
    with pytest.raises(ConfigError, match="KVMESH_ROUTER_TEMPERATURE must be a number, got 'hot'"):
        RouterConfig.from_env({"KVMESH_ROUTER_TEMPERATURE": "hot"})
    with pytest.raises(ConfigError, match="KVMESH_ROUTER_KV_EVENTS must be true or false"):
        RouterConfig.from_env({"KVMESH_ROUTER_KV_EVENTS": "maybe"})


def test_load_aware_preset() -> None:
    c = parse("--load-aware", "--router-prefill-load-scale", "3")
    assert (c.overlap_score_credit, c.use_kv_events, c.router_assume_kv_reuse) == (0.0, False, False)
    assert c.router_track_active_blocks and c.router_track_prefill_tokens and c.prefill_load_scale == 3


def test_every_flag_has_help_text() -> None:
    p = argparse.ArgumentParser()
    RouterConfig.add_arguments(p)
    text = p.format_help()
    for flag in (
        "--router-temperature",
        "--router-kv-overlap-score-credit",
        "--router-queue-policy",
        "--active-prefill-tokens-threshold-frac",
        "--router-track-output-blocks",
        "--load-aware",
    ):
        assert flag in text


def test_with_overrides_validates() -> None:
    assert RouterConfig().with_overrides(router_temperature=2.0).router_temperature == 2.0
    with pytest.raises(ConfigError, match="unknown router setting"):
        RouterConfig().with_overrides(nope=1)


@pytest.mark.parametrize("mode", ["round-robin", "random"])
@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (("--router-temperature", "0.5"), "--router-temperature"),
        (("--no-router-kv-events",), "--router-kv-events"),
        (("--router-cost-model", "dynamo"), "--router-cost-model"),
        (
            ("--router-prefill-load-scale", "8", "--router-ttl-secs", "30"),
            "--router-prefill-load-scale, --router-ttl-secs",
        ),
        (("--load-aware",), "--load-aware"),
    ],
)
def test_a_cost_flag_beside_a_mode_without_a_cost_is_refused_naming_it(
    mode: str, flags: tuple[str, ...], named: str
) -> None:
    with pytest.raises(ConfigError, match=f"^{named}: no effect with --router-mode {mode}"):
        parse("--router-mode", mode, *flags)
    with pytest.raises(ConfigError, match="--router-temperature: no effect"):
        RouterConfig.from_env({"KVMESH_ROUTER_MODE": mode, "KVMESH_ROUTER_TEMPERATURE": "0.5"})
    # the same value as the default changes nothing: not refused
    assert parse("--router-mode", mode, "--router-temperature", "0").router_mode == mode
