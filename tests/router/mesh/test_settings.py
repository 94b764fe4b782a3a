"""kvmesh/router/mesh/settings.py: env, TOML file and flags, in that order of precedence."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvmesh.errors import ConfigError
from kvmesh.router.core.config import RouterConfig
from kvmesh.router.core.settings_table import Setting
from kvmesh.router.mesh import settings as mesh_settings
from kvmesh.router.mesh.settings import (
    MAX_CONFIG_BYTES,
    SETTINGS,
    MeshSettings,
    add_arguments,
    parse_worker_list,
)


def _flags(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    RouterConfig.add_arguments(parser)
    return parser.parse_args(list(argv))


def _from_file(tmp_path: Path, text: str) -> MeshSettings:
    path = tmp_path / "kvmesh.toml"
    path.write_text(text)
    return MeshSettings.load({"KVMESH_CONFIG": str(path)})


def test_worker_urls_are_normalized() -> None:
    specs = parse_worker_list("127.0.0.1:8001, http://127.0.0.1:8002/")
    assert [s.url for s in specs] == ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    assert [s.worker_id for s in specs] == [s.url for s in specs]


@pytest.mark.parametrize(
    # (an unclosed bracket was a ValueError from the URL parser: a 500 at POST /kvmesh/workers)
    "bad",
    ["ftp://x:1", "http://", "http://h:99999", "http://h:1/?q=1", "http://[::1", "http://[nope]:1"],
)
def test_bad_worker_urls(bad: str) -> None:
    with pytest.raises(ConfigError, match="worker URL"):
        parse_worker_list(bad)


@pytest.mark.parametrize(
    "bad",
    # (the URL parser drops a tab or newline without a word, and a space broke the request line)
    ["http://h:1/a b", "http://h:1/x\r\nX-Evil: 1", "http://127.0.0.1\t:80", "h:1/caf\u00e9", "h:1/\x7f"],
)
def test_worker_urls_kvmesh_cannot_send_as_written_are_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match="printable ASCII"):
        parse_worker_list(bad)


def test_credentials_in_a_worker_url_are_refused() -> None:
    # (nothing would send them, and a URL-only worker's id, the URL, rides in every answer)
    with pytest.raises(ConfigError, match="credentials"):
        parse_worker_list("http://user:secret@127.0.0.1:8001")


def test_a_host_in_another_script_is_idna_encoded_and_is_the_id() -> None:
    (spec,) = parse_worker_list("http://b\u00fccher.example:8001/")
    assert spec.url == spec.worker_id == "http://xn--bcher-kva.example:8001"
    (spec,) = parse_worker_list("b\u00fccher.example")
    assert spec.url == "http://xn--bcher-kva.example"


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
    with pytest.raises(ConfigError, match="KVMESH_MAX_BODY_BYTES must be an integer, got 'lots'"):
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
        ("[router]\nrouter_temperature = -1", r"\[router\] router_temperature must be >= 0"),
        ("not toml [", "not valid TOML"),
        (  # (ZMQ dials a port past 65535 modulo 65,536: another stream, or none, shown as live)
            "[[workers]]\nurl = 'http://h:1'\nkv_events_endpoints = ['tcp://h:70000']",
            r"workers\[0\].kv_events_endpoints entry 'tcp://h:70000' has port '70000'; a TCP port is "
            "a number from 1 to 65535",
        ),
        (
            "[[workers]]\nurl = 'http://h:1'\nkv_replay_endpoints = ['tcp://h:0']",
            r"workers\[0\].kv_replay_endpoints entry 'tcp://h:0' has port '0'",
        ),
        (  # (one slash: the subscription failed in a task nobody awaited; events "live", none came)
            "[[workers]]\nurl = 'http://h:1'\nkv_events_endpoints = ['tcp:/h:5557']",
            r"workers\[0\].kv_events_endpoints entry 'tcp:/h:5557' is not a ZMQ endpoint: tcp://host:port, "
            "ipc://path or inproc://name",
        ),
        (
            "[[workers]]\nurl = 'http://h:1'\nkv_replay_endpoints = ['nats:kvmesh.events.w.0']",
            r"workers\[0\].kv_replay_endpoints entry 'nats:kvmesh.events.w.0' is not a ZMQ endpoint",
        ),
        (
            "[[workers]]\nurl = 'http://h:1'\nkv_replay_endpoints = ['tcp://[::]:5558']",
            r"workers\[0\].kv_replay_endpoints entry 'tcp://\[::\]:5558' names '\[::\]', every interface",
        ),
        (  # (a wildcard would have applied every worker's events to this one's index)
            "[[workers]]\nurl = 'http://h:1'\nkv_events_endpoints = ['nats:kvmesh.events.>']",
            r"workers\[0\].kv_events_endpoints entry 'nats:kvmesh.events.>' must be a NATS subject of "
            "tokens",
        ),
        (
            "[[workers]]\nurl = 'http://h:1'\nkv_events_endpoints = ['tcp://*:5557']",
            r"entry 'tcp://\*:5557' names the wildcard host '\*', which can be bound but not connected to; "
            "set KVMESH_ADVERTISE_HOST",
        ),
    ],
)
def test_bad_toml(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        MeshSettings.load({"KVMESH_CONFIG": str(path)})


def test_a_config_file_that_is_not_text_or_too_large_is_refused_naming_it(tmp_path: Path) -> None:
    """A binary file was a UnicodeDecodeError traceback, and ``/dev/zero`` was read until the
    memory ran out."""
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"block_size = 16\n\xd0\x00")
    with pytest.raises(ConfigError, match=r"config file .*binary.toml is not UTF-8 text \(byte 16\)"):
        MeshSettings.load({"KVMESH_CONFIG": str(binary)})
    large = tmp_path / "large.toml"
    with large.open("wb") as f:
        f.truncate(MAX_CONFIG_BYTES + 1)  # (sparse: nothing is written)
    for path in (str(large), "/dev/zero"):
        with pytest.raises(ConfigError, match=r"is larger than 8 MiB: is it the right file\?"):
            MeshSettings.load({"KVMESH_CONFIG": path})


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("flag", r"--block-size must be >= 1, got '-4'"),
        ("env", r"KVMESH_BLOCK_SIZE must be >= 1, got '-4'"),
        ("file", r"kvmesh.toml: block_size must be >= 1, got -4"),
        ("object", r"--block-size must be >= 1, got -4"),
    ],
)
def test_a_negative_block_size_is_refused_by_every_source(tmp_path: Path, source: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        if source == "flag":
            MeshSettings.load({}, _flags("--block-size", "-4"))
        elif source == "env":
            MeshSettings.load({"KVMESH_BLOCK_SIZE": "-4"})
        elif source == "file":
            _from_file(tmp_path, "block_size = -4")
        else:
            MeshSettings(block_size=-4)


# A valid value other than the default for every field that has a row, in each source's spelling.
_SAMPLES: dict[str, tuple[str, str, Any]] = {
    # field: (flag / variable text, TOML literal, the value it becomes)
    "workers": ("127.0.0.1:1,127.0.0.1:2", '["127.0.0.1:1", "127.0.0.1:2"]', ("http://127.0.0.1:1", "http://127.0.0.1:2")),
    "prefill_workers": ("127.0.0.1:3", '["127.0.0.1:3"]', ("http://127.0.0.1:3",)),
    "tokenizer": ("engine", '"engine"', "engine"),
    "admin_token": ("s3cret", '"s3cret"', "s3cret"),
    "worker_token": ("w0rker", '"w0rker"', "w0rker"),
    "mesh_secret": ("m3sh", '"m3sh"', "m3sh"),
    "body_read_timeout": ("5", "5", 5.0),
    "max_body_bytes": ("1000", "1000", 1000),
    "log_requests": ("true", "true", True),
    "max_upload_bytes": ("2000", "2000", 2000),
    "self_url": ("127.0.0.1:2", '"127.0.0.1:2"', "http://127.0.0.1:2"),
    "self_worker_id": ("http://127.0.0.1:2", '"http://127.0.0.1:2"', "http://127.0.0.1:2"),
    "block_size": ("32", "32", 32),
    "health_interval": ("0.5", "0.5", 0.5),
    "health_failures": ("5", "5", 5),
    "connect_timeout": ("1.5", "1.5", 1.5),
    "kv_state_timeout": ("120", "120", 120.0),
    "sync_endpoint": ("tcp://127.0.0.1:5600", '"tcp://127.0.0.1:5600"', "tcp://127.0.0.1:5600"),
    "sync_peers": ("tcp://127.0.0.1:5601", '["tcp://127.0.0.1:5601"]', ("tcp://127.0.0.1:5601",)),
    "event_plane": ("nats://127.0.0.1:4222", '"nats://127.0.0.1:4222"', "nats://127.0.0.1:4222"),
    "nats_token": ("s3cret", '"s3cret"', "s3cret"),
    "nats_user": ("kv", '"kv"', "kv"),
    "nats_password": ("pw", '"pw"', "pw"),
    "nats_creds": ("/etc/kvmesh.creds", '"/etc/kvmesh.creds"', "/etc/kvmesh.creds"),
    "nats_tls_ca": ("/etc/ca.pem", '"/etc/ca.pem"', "/etc/ca.pem"),
    "nats_tls_cert": ("/etc/c.pem", '"/etc/c.pem"', "/etc/c.pem"),
    "nats_tls_key": ("/etc/k.pem", '"/etc/k.pem"', "/etc/k.pem"),
    "nats_prefix": ("fleet2", '"fleet2"', "fleet2"),
    "nats_stream_max_age": ("60", "60", 60.0),
    "nats_stream_max_bytes": ("1048576", "1048576", 1048576),
    "nats_replicas": ("3", "3", 3),
    "nats_worker_ttl": ("20", "20", 20.0),
}  # fmt: skip
# What a row needs besides itself: NATS options need the NATS plane, a TLS certificate its key.
_NEEDS = {
    "nats_tls_cert": {"KVMESH_NATS_TLS_KEY": "/etc/k.pem"},
    "nats_tls_key": {"KVMESH_NATS_TLS_CERT": "/etc/c.pem"},
}


def _value(s: MeshSettings, field: str) -> Any:
    if field == "prefill_workers":  # merged into the fleet, with their role
        return tuple(w.url for w in s.workers if w.role == "prefill")
    value = getattr(s, field)
    return tuple(w.url for w in value if w.role != "prefill") if field == "workers" else value


def test_every_row_has_a_sample_and_samples_differ_from_the_defaults() -> None:
    assert {row.field for row in SETTINGS} == set(_SAMPLES)
    for row in SETTINGS:
        assert _SAMPLES[row.field][2] != row.default, row.field


@pytest.mark.parametrize("row", SETTINGS, ids=lambda row: row.field)
def test_every_setting_is_read_from_the_file_the_environment_and_its_flag(
    tmp_path: Path, row: Setting
) -> None:
    text, literal, expected = _SAMPLES[row.field]
    # the self URL must be one of the workers: give the fleet in every case
    fleet = {"KVMESH_WORKERS": "127.0.0.1:1,127.0.0.1:2"} if row.field != "workers" else {}
    if row.field.startswith("nats_"):
        fleet = {**fleet, "KVMESH_EVENT_PLANE": "nats://127.0.0.1:4222", **_NEEDS.get(row.field, {})}
    path = tmp_path / "kvmesh.toml"
    path.write_text(f"{row.key} = {literal}\n")
    assert _value(MeshSettings.load({**fleet, "KVMESH_CONFIG": str(path)}), row.field) == expected
    assert row.env is not None
    assert _value(MeshSettings.load({**fleet, row.env: text}), row.field) == expected
    if row.flag is not None:  # only an embedded engine's own identity has no flag
        argv = (row.flag,) if row.kind is bool else (row.flag, text)  # (a switch takes no value)
        assert _value(MeshSettings.load(fleet, _flags(*argv)), row.field) == expected
    else:
        assert row.field in ("self_url", "self_worker_id")


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"KVMESH_HEALTH_FAILURES": "0"}, "KVMESH_HEALTH_FAILURES must be >= 1, got '0'"),
        ({"KVMESH_CONNECT_TIMEOUT": "0"}, "KVMESH_CONNECT_TIMEOUT must be > 0, got '0'"),
        ({"KVMESH_KV_STATE_TIMEOUT": "soon"}, "KVMESH_KV_STATE_TIMEOUT must be a number, got 'soon'"),
        ({"KVMESH_HEALTH_INTERVAL": "-1"}, "KVMESH_HEALTH_INTERVAL must be > 0, got '-1'"),
        (
            {"KVMESH_SYNC_PEERS": "udp://x:1"},
            "KVMESH_SYNC_PEERS entry 'udp://x:1' must look like tcp://host:port",
        ),
        (  # (a peer is connected to: any free port means nothing there)
            {"KVMESH_SYNC_PEERS": "tcp://x:*"},
            "KVMESH_SYNC_PEERS entry 'tcp://x:*' has port '*'; a TCP port is a number from 1 to 65535",
        ),
        (
            {"KVMESH_SYNC_ENDPOINT": "tcp://x:65536"},
            "KVMESH_SYNC_ENDPOINT 'tcp://x:65536' has port '65536'; a TCP port is a number from 0 to 65535",
        ),
        (
            {"KVMESH_EVENT_PLANE": "redis://x:1"},
            "event plane server 'redis://x:1' must look like nats://host:port",
        ),
        (
            {"KVMESH_EVENT_PLANE": "nats://[::1"},  # (the URL parser's ValueError, a traceback)
            "event plane server 'nats://[::1' must look like nats://host:port",
        ),
        (
            {"KVMESH_NATS_TOKEN": "t"},
            "--nats-token needs --event-plane nats://host:port (the event plane is zmq)",
        ),
        (
            {"KVMESH_EVENT_PLANE": "nats://x:1", "KVMESH_NATS_TLS_CERT": "c.pem"},
            "--nats-tls-cert and --nats-tls-key go together",
        ),
        # What the NATS server would refuse, after which the plane retried for ever without a word:
        # a prefix that is no subject token, limits past JetStream's 64-bit fields.
        (
            {"KVMESH_EVENT_PLANE": "nats://x:1", "KVMESH_NATS_PREFIX": "a b"},
            "KVMESH_NATS_PREFIX must be one NATS subject token of letters, digits, '_' and '-'",
        ),
        (
            {"KVMESH_EVENT_PLANE": "nats://x:1", "KVMESH_NATS_PREFIX": "fleet.2"},
            "KVMESH_NATS_PREFIX must be one NATS subject token",
        ),
        (
            {"KVMESH_EVENT_PLANE": "nats://x:1", "KVMESH_NATS_STREAM_MAX_AGE": "1e10"},
            "KVMESH_NATS_STREAM_MAX_AGE must be in (0, 9223372036], got '1e10'",
        ),
        (
            {"KVMESH_EVENT_PLANE": "nats://x:1", "KVMESH_NATS_STREAM_MAX_BYTES": str(2**60 + 1)},
            f"KVMESH_NATS_STREAM_MAX_BYTES must be in [1, {2**60}], got '{2**60 + 1}'",
        ),
        (
            {"KVMESH_EVENT_PLANE": "nats://x:1", "KVMESH_NATS_WORKER_TTL": "1e300"},
            "KVMESH_NATS_WORKER_TTL must be in (0, 9223372036], got '1e300'",
        ),
    ],
)
def test_out_of_range_values_name_the_variable_and_the_range(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        MeshSettings.load(env)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tokenizer = 5", "tokenizer must be a string, got 5"),
        ("health_failures = true", "health_failures must be an integer, got True"),
        ("sync_peers = [5]", "sync_peers must be a list of endpoint strings"),
        ("workers = [5]", "workers[0] must be a URL or a table, got 5"),
    ],
)
def test_wrong_types_in_the_file_name_the_key(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        _from_file(tmp_path, text)


def test_router_help_shows_every_setting_with_its_default() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvmesh", "router", "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    # option blocks: a line starting with "  --" and its wrapped continuation lines
    blocks: dict[str, str] = {}
    flag = None
    for line in result.stdout.splitlines():
        if line.startswith("  --"):
            flag = line.split()[0].rstrip(",")
            blocks[flag] = line
        elif flag is not None and line.startswith(" " * 10):
            blocks[flag] += " " + line.strip()
        else:
            flag = None
    texts = {flag: " ".join(block.split()) for flag, block in blocks.items()}
    shown = {
        "workers": "none", "prefill_workers": "none", "admin_token": "none", "worker_token": "none",
        "mesh_secret": "none", "max_body_bytes": "8 MiB", "max_upload_bytes": "32 MiB",
        "block_size": "from the workers, else 16", "sync_endpoint": "tcp://<self host>:*", "sync_peers": "none",
        **dict.fromkeys(("nats_token", "nats_user", "nats_password", "nats_creds", "nats_tls_ca",
                         "nats_tls_cert", "nats_tls_key"), "none"),
        "nats_stream_max_bytes": "1 GiB",
    }  # fmt: skip
    for row in SETTINGS:
        if row.flag is not None:
            assert texts[row.flag].endswith(f"[{shown.get(row.field, row.default)}]"), texts[row.flag]
    # every other option (routing flags, --host...) ends with its default too, but --help and the
    # deprecated alias of --router-prefill-load-scale
    others = [t for f, t in texts.items() if f not in ("--help", "--router-kv-overlap-score-weight")]
    assert len(others) > 40
    assert [t for t in others if not re.search(r"\[[^\]]+\]$", t)] == []


def test_the_module_docstring_lists_every_variable() -> None:
    doc = mesh_settings.__doc__ or ""
    missing = [row.env for row in SETTINGS if row.env and row.env not in doc]
    assert not missing
