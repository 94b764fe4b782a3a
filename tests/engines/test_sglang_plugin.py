"""kvmesh's plugin and launcher against SGLang 0.5.23's own plugin loader, publisher factory,
hook registry and argument parser, on CPU (``make test-engines``).

kvmesh is not installed into the engine environment: :func:`sglang_env.install_entry_point`
builds a dist-info from this checkout's pyproject.toml, so SGLang's ``load_plugins()`` discovers
the entry point exactly as it would after ``pip install 'kvmesh[sglang]'``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.engines import sglang_env

pytestmark = [pytest.mark.engine_sglang, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """SGLang's load_plugins() run once in this process with kvmesh's entry point visible."""
    sglang_env.prepare()
    sglang_env.install_entry_point(tmp_path_factory.mktemp("dist"))
    plugins = sglang_env.engine("sglang.srt.plugins")
    kv = sglang_env.engine("sglang.srt.disaggregation.kv_events")
    scheduler = sglang_env.engine("sglang.srt.managers.scheduler")
    original = scheduler.Scheduler.process_input_requests
    found = plugins.load_plugins_by_group("sglang.srt.plugins")
    plugins._plugins_loaded = False
    plugins.load_plugins()
    return {"found": found, "kv": kv, "scheduler": scheduler, "original": original}


def test_load_plugins_finds_and_runs_kvmeshs_entry_point(loaded: dict[str, Any]) -> None:
    from kvmesh.adapters.sglang.plugin import register
    from kvmesh.adapters.sglang.publisher import KvMeshPublisher

    func, dist = loaded["found"]["kvmesh"]
    assert func is register and dist == "kvmesh"
    assert loaded["kv"].EventPublisherFactory._registry["kvmesh"] is KvMeshPublisher


def test_registration_is_idempotent(loaded: dict[str, Any]) -> None:
    from kvmesh.adapters.sglang.plugin import register

    register()
    register()  # SGLang's factory raises KeyError on a second registration of a name: not reached


def test_scheduler_hooks_are_applied_by_sglangs_registry(loaded: dict[str, Any]) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from kvmesh.adapters.sglang import scheduler_hooks

    target = "sglang.srt.managers.scheduler.Scheduler"
    assert (HookType.AFTER, scheduler_hooks.after_process_input_requests) in [
        (t, h) for t, h, _ in HookRegistry._hooks[f"{target}.process_input_requests"]
    ]
    assert (HookType.AFTER, scheduler_hooks.after_flush_cache) in [
        (t, h) for t, h, _ in HookRegistry._hooks[f"{target}.flush_cache"]
    ]
    assert f"{target}.process_input_requests" in HookRegistry._patched
    # The class attribute is now SGLang's hook wrapper (whichever test applied the hooks first).
    patched = loaded["scheduler"].Scheduler.process_input_requests
    assert patched.__code__.co_filename.endswith("hook_registry.py")


def test_factory_creates_kvmesh_publisher_per_rank(loaded: dict[str, Any]) -> None:
    from kvmesh.adapters.sglang.publisher import KvMeshPublisher
    from tests.events.eventkit import free_tcp_port_runs

    base, replay = free_tcp_port_runs(2, length=2)  # rank 1 binds each base port + 1
    config = json.dumps(
        {
            "publisher": "kvmesh",
            "endpoint": f"tcp://127.0.0.1:{base}",
            "replay_endpoint": f"tcp://127.0.0.1:{replay}",
        }
    )
    pub = loaded["kv"].EventPublisherFactory.create(config, attn_dp_rank=1)
    try:
        assert isinstance(pub, KvMeshPublisher)
        assert pub.endpoint == f"tcp://127.0.0.1:{base + 1}"
        assert pub.replay_endpoint == f"tcp://127.0.0.1:{replay + 1}"
    finally:
        pub.shutdown()


def test_publisher_refuses_colliding_port_ranges(
    loaded: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvmesh.errors import ConfigError

    monkeypatch.setenv("KVMESH_SGLANG_DP_SIZE", "2")
    config = json.dumps(
        {"publisher": "kvmesh", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}
    )
    with pytest.raises(ConfigError, match="put the replay port at 5559 or above"):
        loaded["kv"].EventPublisherFactory.create(config, attn_dp_rank=0)


# --- the launcher's argument handling, against SGLang's real prepare_server_args ----------------


def test_launcher_strips_kvmesh_flags_and_injects_events(
    loaded: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    from kvmesh.adapters.sglang import launcher

    env: dict[str, str] = {}
    args = launcher.prepare(
        [
            "--model-path",
            "dummy",
            "--dp-size",
            "2",
            "--kvmesh-workers",
            "http://a:1,http://b:2",
            "--kvmesh-events-port=6000",
            "--enable-priority-scheduling",
            "--schedule-low-priority-values-first",
        ],
        environ=env,
    )
    assert env["KVMESH_WORKERS"] == "http://a:1,http://b:2"
    assert env["KVMESH_SGLANG_DP_SIZE"] == "2"
    assert env["KVMESH_SGLANG_CONTROL"].startswith("ipc://")
    assert json.loads(args.kv_events_config) == {
        "publisher": "kvmesh",
        "endpoint": "tcp://*:6000",
        "replay_endpoint": "tcp://*:6002",
    }
    assert args.dp_size == 2 and args.schedule_low_priority_values_first
    assert "--enable-priority-scheduling" not in capsys.readouterr().err


def test_launcher_warns_loudly_without_priority_scheduling(
    loaded: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    from kvmesh.adapters.sglang import launcher

    launcher.prepare(["--model-path", "dummy"], environ={})
    assert "WARNING kvmesh: SGLang runs without --enable-priority-scheduling" in capsys.readouterr().err


def test_launcher_keeps_a_given_kv_events_config(loaded: dict[str, Any]) -> None:
    from kvmesh.adapters.sglang import launcher

    given = '{"publisher": "zmq", "endpoint": "tcp://*:7000"}'
    args = launcher.prepare(["--model-path", "dummy", "--kv-events-config", given], environ={})
    assert args.kv_events_config == given


def test_launcher_exit_codes_match_sglangs(tmp_path: Path) -> None:
    """An unknown flag is argparse's exit 2 in both; an unknown kvmesh flag too, with its name."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(sglang_env.REPO), str(sglang_env.STUBS)])}

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, *argv], capture_output=True, text=True, env=env, timeout=240, cwd=tmp_path
        )

    ours = run("-m", "kvmesh.adapters.sglang", "--model-path", "dummy", "--no-such-flag")
    theirs = run("-m", "sglang.launch_server", "--model-path", "dummy", "--no-such-flag")
    assert ours.returncode == theirs.returncode == 2
    assert "unrecognized arguments: --no-such-flag" in ours.stderr
    bad = run("-m", "kvmesh.adapters.sglang", "--model-path", "dummy", "--kvmesh-nope", "1")
    assert bad.returncode == 2 and "unknown kvmesh flag --kvmesh-nope" in bad.stderr
