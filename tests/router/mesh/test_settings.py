"""kvmesh/router/mesh/settings.py: env, TOML file and flags, in that order of precedence."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvmesh.errors import ConfigError
from kvmesh.router.core.config import RouterConfig
from kvmesh.router.mesh.settings import MeshSettings, add_arguments, parse_worker_list


def test_worker_urls_are_normalized() -> None:
    specs = parse_worker_list("127.0.0.1:8001, http://127.0.0.1:8002/")
    assert [s.url for s in specs] == ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    assert [s.worker_id for s in specs] == [s.url for s in specs]


@pytest.mark.parametrize("bad", ["ftp://x:1", "http://", "http://h:99999", "http://h:1/?q=1"])
def test_bad_worker_urls(bad: str) -> None:
    with pytest.raises(ConfigError, match="worker URL"):
        parse_worker_list(bad)


def test_env() -> None:
    s = MeshSettings.load(
        {
            "KVMESH_WORKERS": "http://127.0.0.1:1,http://127.0.0.1:2",
            "KVMESH_SELF_URL": "127.0.0.1:2",
            "KVMESH_MAX_BODY_BYTES": "1000",
            "KVMESH_ROUTER_TEMPERATURE": "0.5",
            "KVMESH_ADMIN_TOKEN": "t",
        }
    )
    assert s.self_worker_id == "http://127.0.0.1:2"
    assert s.embedded_worker is not None and s.embedded_worker.url == "http://127.0.0.1:2"
    assert s.max_body_bytes == 1000
    assert s.router.router_temperature == 0.5
    assert s.admin_token == "t"


def test_self_url_must_be_a_worker() -> None:
    with pytest.raises(ConfigError, match="not among the workers"):
        MeshSettings.load({"KVMESH_WORKERS": "http://127.0.0.1:1", "KVMESH_SELF_URL": "http://127.0.0.1:9"})


def test_duplicate_workers_are_refused() -> None:
    with pytest.raises(ConfigError, match="configured twice"):
        MeshSettings.load({"KVMESH_WORKERS": "http://127.0.0.1:1,127.0.0.1:1"})


def test_bad_numbers_name_the_variable() -> None:
    with pytest.raises(ConfigError, match="KVMESH_MAX_BODY_BYTES must be a positive integer"):
        MeshSettings.load({"KVMESH_MAX_BODY_BYTES": "lots"})


def test_toml_file_then_env_then_flags(tmp_path: Path) -> None:
    path = tmp_path / "kvmesh.toml"
    path.write_text(
        """
tokenizer = "builtin"
max_body_bytes = 2000
[router]
router_temperature = 0.25
router_mode = "kv"
[[workers]]
url = "http://127.0.0.1:8001"
[[workers]]
url = "http://127.0.0.1:8002"
id = "gpu-2"
backend = "vllm"
block_size = 16
kv_events_endpoints = ["tcp://127.0.0.1:5557"]
max_num_batched_tokens = 8192
total_kv_blocks = 1000
priority_polarity = "lower_first"
"""
    )
    s = MeshSettings.load({"KVMESH_CONFIG": str(path), "KVMESH_MAX_BODY_BYTES": "3000"})
    assert s.max_body_bytes == 3000  # env beats the file
    assert s.router.router_temperature == 0.25
    described = s.workers[1]
    assert described.worker_id == "gpu-2" and described.described
    assert described.kv_events_endpoints == ("tcp://127.0.0.1:5557",)
    assert not s.workers[0].described

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    RouterConfig.add_arguments(parser)
    args = parser.parse_args(["--max-body-bytes", "4000", "--router-temperature", "0.75"])
    s = MeshSettings.load({"KVMESH_CONFIG": str(path), "KVMESH_MAX_BODY_BYTES": "3000"}, args)
    assert s.max_body_bytes == 4000  # flags beat env
    assert s.router.router_temperature == 0.75
    assert len(s.workers) == 2  # no --workers: the file's list stays


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("workers = 3", "workers must be a list"),
        (
            "[[workers]]\nurl = 'http://h:1'\nblock_size = 0",
            r"workers\[0\].block_size must be a positive integer",
        ),
        ("[[workers]]\nurl = 'http://h:1'\ncolour = 'red'", "unknown key 'colour'"),
        ("bogus = 1", "unknown setting 'bogus'"),
        ("[router]\nrouter_temperature = -1", "--router-temperature"),
        ("not toml [", "not valid TOML"),
    ],
)
def test_bad_toml(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        MeshSettings.load({"KVMESH_CONFIG": str(path)})
