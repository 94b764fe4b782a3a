"""Fixtures for the KV-event tests: endpoints on loopback tcp and ipc, and a ZMQ socket-hygiene
check."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq
from eventkit import free_tcp_port


@pytest.fixture(params=["tcp", "ipc"])
def endpoint_factory(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[str], str]:
    """``make(name)`` -> a fresh concrete endpoint on the parametrized transport."""

    def make(name: str) -> str:
        if request.param == "tcp":
            return f"tcp://127.0.0.1:{free_tcp_port()}"
        path = tmp_path / f"{name}.sock"
        assert len(str(path)) < 100, "ipc paths are limited to ~107 bytes"
        return f"ipc://{path}"

    return make


def _open_sockets() -> set[zmq.Socket[bytes]]:
    return {s for s in list(zmq.Context.instance()._sockets) if not s.closed}  # type: ignore[attr-defined]


@pytest.fixture(autouse=True)
def no_leaked_sockets() -> Iterator[None]:
    """Fail a test that leaves a ZMQ socket open (publisher threads close theirs on close())."""
    before = _open_sockets()
    yield
    leaked = _open_sockets() - before
    assert not leaked, f"sockets left open: {leaked}"
