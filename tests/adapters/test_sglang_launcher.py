"""The SGLang launcher's own argument handling, which runs before SGLang is imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvmesh.adapters.sglang.launcher import with_kv_events
from kvmesh.errors import ConfigError


def test_the_event_ports_of_every_rank_fit_below_65536() -> None:
    """Rank r publishes on the base port plus r and replays on the base plus dp plus r: past 65535
    the publisher inside SGLang's scheduler would have failed only once the engine was up."""
    argv = with_kv_events(["--dp-size", "2"], 65532)
    config = json.loads(argv[argv.index("--kv-events-config") + 1])
    assert (config["endpoint"], config["replay_endpoint"]) == ("tcp://*:65532", "tcp://*:65534")
    with pytest.raises(ConfigError, match=r"needs ports 65533 to 65536 .* past 65535"):
        with_kv_events(["--dp-size", "2"], 65533)
    with pytest.raises(ConfigError, match="needs ports 65535 to 65536"):
        with_kv_events([], 65535)
    with pytest.raises(
        ConfigError, match="with 40000 data-parallel rank"
    ):  # (no count is too large to check)
        with_kv_events(["--dp-size", "40000"], 5557)


def test_a_dp_size_that_is_not_a_count_is_left_to_sglangs_parser() -> None:
    """``int()`` of it was a ValueError traceback before SGLang's own parser could name the flag."""
    argv = with_kv_events(["--dp-size", "two"], 5557)
    config = json.loads(argv[-1])
    assert config["replay_endpoint"] == "tcp://*:5558"
    assert argv[:2] == ["--dp-size", "two"]


@pytest.mark.parametrize(
    ("flags", "env", "message"),
    [
        (["--kvmesh-workers", "ftp://x"], {}, "worker URL 'ftp://x' must look like http://host:port"),
        (
            ["--kvmesh-workers", "http://127.0.0.1:30000"],
            {"KVMESH_ROUTER_TEMPERATURE": "hot"},
            "KVMESH_ROUTER_TEMPERATURE must be a number, got 'hot'",
        ),
        ([], {"KVMESH_PIN_BUDGET": "2"}, "KVMESH_PIN_BUDGET must be a fraction between 0 and 1, got '2'"),
    ],
)
def test_kvmesh_settings_are_read_before_sglang_starts(
    flags: list[str], env: dict[str, str], message: str
) -> None:
    """SGLang mounts kvmesh's middleware as its HTTP server starts, and its schedulers read the pin
    budget as they start: both after the model has loaded, so a wrong setting was said minutes in,
    by a traceback. The launcher reads them first, before SGLang is imported (this venv has none)."""
    done = subprocess.run(
        [sys.executable, "-m", "kvmesh.adapters.sglang", "--model-path", "m", *flags],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"kvmesh: {message}" in done.stderr
    assert "Traceback" not in done.stderr  # (SGLang's absence would have been said first otherwise)


@pytest.mark.parametrize(
    ("module", "message"),
    [
        (
            "kvmesh.adapters.sglang",
            "kvmesh: kvmesh's SGLang adapter needs SGLang 0.5.23: pip install 'kvmesh[sglang]'",
        ),
        ("kvmesh.adapters.trtllm", "kvmesh: kvmesh's TensorRT-LLM adapter needs TensorRT-LLM"),
    ],
)
def test_a_launcher_without_its_engine_says_what_to_install(module: str, message: str) -> None:
    """This venv has neither engine. The launchers said so in an ImportError traceback."""
    done = subprocess.run(
        [sys.executable, "-m", module, "--model-path" if "sglang" in module else "m", "m"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1, done.stderr[-2000:]
    assert message in done.stderr
    assert "Traceback" not in done.stderr
