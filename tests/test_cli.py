"""The `kvmesh` console script as a user runs it."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh.cli import COMMANDS


def _kvmesh(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvmesh", *args], capture_output=True, text=True, timeout=60)


def test_help_lists_every_subcommand() -> None:
    result = _kvmesh("--help")
    assert result.returncode == 0, result.stderr
    for name in ("router", "mock", "demo", "bench", "events"):
        assert name in COMMANDS
        assert f"    {name}" in result.stdout


def test_every_subcommand_has_help_for_every_flag() -> None:
    # (a command of actions: the help of each action with flags)
    actions = {"events": ("tap", "relay", "trtllm"), "native": ("build",)}
    for name, action in [(n, a) for n in COMMANDS for a in actions.get(n, (None,))]:
        args = (name, action, "--help") if action else (name, "--help")
        result = _kvmesh(*args)
        assert result.returncode == 0, f"kvmesh {' '.join(args)}: {result.stderr}"
        assert "is not available" not in result.stdout + result.stderr
        flags = [line.split()[0] for line in result.stdout.splitlines() if line.strip().startswith("--")]
        assert flags, f"kvmesh {name} --help shows no flags"
        for line in result.stdout.splitlines():
            stripped = line.strip()
            if stripped.startswith("--") and len(stripped.split("  ")) == 1:
                # The description may wrap onto the next line; a flag with no text at all is a defect.
                index = result.stdout.splitlines().index(line)
                following = (
                    result.stdout.splitlines()[index + 1]
                    if index + 1 < len(result.stdout.splitlines())
                    else ""
                )
                assert following.startswith(" " * 10), f"kvmesh {name}: flag without help: {stripped}"


def test_missing_subcommand_is_a_usage_error() -> None:
    result = _kvmesh()
    assert result.returncode == 2
    assert "COMMAND" in result.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--engines", "0"], "argument --engines: must be at least 1, got 0"),
        (["--engines", "-1"], "argument --engines: must be at least 1, got -1"),
        (["--engines", "1000000"], "argument --engines: must be at most 64 (each engine is a process"),
        (["--speedup", "0"], "argument --speedup: must be greater than 0, got 0"),
        (["--num-blocks", "0"], "argument --num-blocks: must be at least 1, got 0"),
        (  # (a traceback once the first engine process had refused it)
            ["--num-blocks", "99999999"],
            "kvmesh demo: --num-blocks must be at most 4194304 (each simulated block is an object in memory)",
        ),
        (["--block-size", "0"], "argument --block-size: must be at least 1, got 0"),
        (["--sessions", "0"], "argument --sessions: must be at least 1, got 0"),
        (["--turns", "0"], "argument --turns: must be at least 1, got 0"),
        (["--max-tokens", "-3"], "argument --max-tokens: must be at least 1, got -3"),
        (["--concurrency", "0"], "argument --concurrency: must be at least 1, got 0"),
        (["--plot", "/nonexistent-kvmesh-dir/x.png"], "argument --plot: directory /nonexistent-kvmesh-dir"),
        (["--json", "/nonexistent-kvmesh-dir/x.json"], "argument --json: directory /nonexistent-kvmesh-dir"),
    ],
)
def test_demo_refuses_a_bad_value_before_starting_any_engine(flags: list[str], message: str) -> None:
    result = _kvmesh("demo", "--in-process", "--no-progress", *flags)
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in result.stderr
    assert "Traceback" not in result.stderr and "starting" not in result.stderr


def test_demo_refuses_a_directory_as_its_plot_or_json_file(tmp_path: Path) -> None:
    for flag in ("--plot", "--json"):
        result = _kvmesh("demo", "--in-process", "--no-progress", flag, str(tmp_path))
        assert result.returncode == 2, result.stderr[-2000:]
        assert f"argument {flag}: {tmp_path} is a directory, not a file" in result.stderr


@pytest.mark.parametrize(
    ("command", "flags", "message"),
    [
        ("mock", ["--port", "70000"], "argument --port: must be a TCP port from 1 to 65535, got 70000"),
        ("mock", ["--port", "-1"], "argument --port: must be a TCP port from 1 to 65535, got -1"),
        ("mock", ["--log-level", "loud"], "argument --log-level: must be one of critical, error, warning"),
        ("router", ["--port", "99999"], "argument --port: must be a TCP port from 1 to 65535, got 99999"),
        (
            "router",
            ["--log-level", "verbose"],
            "argument --log-level: must be one of critical, error, warning",
        ),
    ],
)
def test_a_server_refuses_a_port_or_log_level_it_cannot_use_before_it_starts(
    command: str, flags: list[str], message: str
) -> None:
    """Past 65535 the server announced the port given and listened on that port modulo 65,536; a
    log level uvicorn does not know was a KeyError traceback at start-up."""
    fleet = ["--workers", "http://127.0.0.1:1"] if command == "router" else []
    result = _kvmesh(command, *fleet, *flags)
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in result.stderr
    assert "Traceback" not in result.stderr and "serving" not in result.stderr


_RELAY = ["events", "relay", "tcp://127.0.0.1:5557", "--nats", "nats://127.0.0.1:1", "--name", "a"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["mock", "--kv-events-endpoint", "tcp://127.0.0.1:70000"],
            "kvmesh mock: error: argument --kv-events-endpoint: 'tcp://127.0.0.1:70000' has port '70000'",
        ),
        (
            ["mock", "--kv-replay-endpoint", "tcp://127.0.0.1:65536"],
            "kvmesh mock: error: argument --kv-replay-endpoint: 'tcp://127.0.0.1:65536' has port",
        ),
        (
            ["events", "tap", "tcp://127.0.0.1:70000", "--timeout", "1"],
            "kvmesh events tap: KV-event endpoint 'tcp://127.0.0.1:70000' has port '70000'",
        ),
        (
            ["events", "tap", "tcp://*:5557", "--timeout", "1"],
            "kvmesh events tap: KV-event endpoint 'tcp://*:5557' names the wildcard host",
        ),
        (  # (a sequence number is 8 bytes on the wire: past them, a traceback at every reconnection)
            ["events", "tap", "tcp://127.0.0.1:5557", "--from-seq", str(2**64)],
            f"argument --from-seq: must be at most {2**64 - 1} (2**64 - 1), got {2**64}",
        ),
        (
            ["events", "tap", "tcp://127.0.0.1:5557", "--replay-endpoint", "tcp://127.0.0.1:99999"],
            "argument --replay-endpoint: 'tcp://127.0.0.1:99999' has port '99999'",
        ),
        (  # (told only for sockets bound to every interface: with none, it would change nothing)
            ["mock", "--advertise-host", "10.0.0.1", "--kv-events-endpoint", "tcp://127.0.0.1:0"],
            "kvmesh mock: --advertise-host names the host told for event sockets bound to every interface",
        ),
        (  # (taken, and at the first gap the live stream was cut at every retry of it)
            ["events", "tap", "tcp://127.0.0.1:5557", "--replay-endpoint", "junk", "--timeout", "1"],
            "argument --replay-endpoint: 'junk' is not a ZMQ endpoint: tcp://host:port, ipc://path or",
        ),
        (
            ["events", "tap", "tcp:/127.0.0.1:5557", "--timeout", "1"],
            "kvmesh events tap: KV-event endpoint 'tcp:/127.0.0.1:5557' is not a ZMQ endpoint",
        ),
        (
            ["events", "relay", "tcp://127.0.0.1:99999", "--nats", "nats://127.0.0.1:1", "--name", "a"],
            "argument ENDPOINT: 'tcp://127.0.0.1:99999' has port '99999'",
        ),
        (  # (a URL kvmesh cannot reach was said as an unreadable /kvmesh/info, or registered as given)
            [
                "events",
                "relay",
                "tcp://127.0.0.1:5557",
                "--nats",
                "nats://127.0.0.1:1",
                "--register",
                "ftp://x",
            ],
            "argument --register: URL 'ftp://x' must look like http://host:port",
        ),
        (  # (the NATS server refused the stream, and the relay retried for ever without a word)
            [*_RELAY, "--nats-prefix", "a b"],
            "kvmesh events relay: --nats-prefix must be one NATS subject token",
        ),
        (
            [*_RELAY, "--nats-replicas", "6"],
            "kvmesh events relay: --nats-replicas must be in [1, 5], got 6",
        ),
        (
            [*_RELAY, "--nats-stream-max-age", "1e300"],
            "kvmesh events relay: --nats-stream-max-age must be in (0, 9223372036], got 1e+300",
        ),
        (  # (taken without a registration, it changed nothing)
            [*_RELAY, "--nats-worker-ttl", "20"],
            "kvmesh events relay: --worker-id, --no-engine-info, --fact and --nats-worker-ttl describe a "
            "registration: add --register URL",
        ),
        (
            [*_RELAY, "--register", "http://127.0.0.1:1", "--fact", "tokens_api=yes"],
            "kvmesh events relay: --fact tokens_api must be true or false, got 'yes'",
        ),
        (
            [*_RELAY, "--register", "http://127.0.0.1:1", "--nats-worker-ttl", "1e10"],
            "kvmesh events relay: --nats-worker-ttl must be at most 9223372036, got 10000000000.0",
        ),
        (  # (nothing to follow: no endpoint given, none to read)
            ["events", "relay", "--nats", "nats://127.0.0.1:4222", "--name", "n"],
            "kvmesh events relay: give the engine's ENDPOINT(s), or --register URL (without "
            "--no-engine-info) to read them from the engine",
        ),
        (
            ["events", "relay", "--nats", "nats://127.0.0.1:4222", "--register", "http://127.0.0.1:1"],
            "kvmesh events relay: cannot read http://127.0.0.1:1/kvmesh/info (",
        ),
    ],
)
def test_an_endpoint_or_url_that_cannot_be_used_is_refused_before_a_socket_opens(
    args: list[str], message: str
) -> None:
    """ZMQ takes a TCP port past 65535 modulo 65,536: ``kvmesh mock --kv-events-endpoint
    tcp://127.0.0.1:70000`` said its events were on port 4464 and served, and the tap followed
    port 4464 without a word. (And the rows' own notes: a sequence number or a URL that could not
    be used either.)"""
    result = _kvmesh(*args)
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("command", ["mock", "router"])
def test_a_server_that_cannot_listen_says_so_before_it_says_it_serves(command: str) -> None:
    """uvicorn bound after the command had printed where it served: a port in use or a host that
    does not resolve was said by uvicorn's log, with exit status 3, under a line claiming the
    server was up."""
    fleet = ["--workers", "http://127.0.0.1:1"] if command == "router" else []
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = _kvmesh(command, *fleet, "--port", str(port))
    unknown = _kvmesh(command, *fleet, "--host", "999.1.1.1", "--port", str(port))
    empty = _kvmesh(command, *fleet, "--host", " ")
    for result, message in [
        (busy, f"kvmesh {command}: cannot listen on 127.0.0.1:{port}: Address already in use"),
        (unknown, f"kvmesh {command}: cannot listen on 999.1.1.1:{port}: "),
        (empty, "argument --host: must name an address, e.g. 127.0.0.1, or 0.0.0.0 for every interface"),
    ]:
        assert result.returncode == 2, result.stderr[-2000:]
        assert message in result.stderr
        assert "serving" not in result.stderr and " on http://" not in result.stderr


def test_the_log_levels_offered_are_uvicorns() -> None:
    from uvicorn.config import LOG_LEVELS as UVICORN

    from kvmesh.commands.argtypes import LOG_LEVELS

    assert set(LOG_LEVELS) == set(UVICORN)


def test_the_router_refuses_a_tokenizer_it_cannot_load_before_it_starts(tmp_path: Path) -> None:
    """A path that does not exist, or a directory with no tokenizer in it, reached the user as a
    ConfigError or ImportError traceback from inside the app's construction."""
    for tokenizer in ("/nonexistent-kvmesh-tokenizer", str(tmp_path)):
        result = _kvmesh("router", "--workers", "http://127.0.0.1:1", "--tokenizer", tokenizer)
        assert result.returncode == 2, result.stderr[-2000:]
        assert f"kvmesh router: the tokenizer {tokenizer!r} (--tokenizer, KVMESH_TOKENIZER)" in result.stderr
        assert "Traceback" not in result.stderr and "kvmesh router on" not in result.stderr
