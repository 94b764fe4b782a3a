"""Fixtures for the KV-event tests: endpoints on loopback tcp and ipc, and a ZMQ socket-hygiene
check."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest

from tests.events.eventkit import free_tcp_port, ipc_endpoint, no_sockets_left_open


@pytest.fixture(params=["tcp", "ipc"])
def endpoint_factory(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[str], str]:
    """``make(name)`` -> a fresh concrete endpoint on the parametrized transport."""

    def make(name: str) -> str:
        if request.param == "tcp":
            return f"tcp://127.0.0.1:{free_tcp_port()}"
        return ipc_endpoint(tmp_path, name)

    return make


@pytest.fixture(autouse=True)
def no_leaked_sockets() -> Iterator[None]:
    """Fail a test that leaves a ZMQ socket open (publisher threads close theirs on close())."""
    with no_sockets_left_open():
        yield


BOTH_LOOPS = frozenset({"test_subscriber", "test_readiness"})
"""Test modules whose async tests run on both event loops: the subscriber's waiting is the event
loop's own (kvmesh.events.readiness), and the router runs under uvicorn, which takes uvloop where
it is installed (the dev extra installs it)."""


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    module = getattr(item, "module", None)
    if module is not None and module.__name__.rpartition(".")[2] in BOTH_LOOPS:
        import uvloop

        return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
    return {"asyncio": asyncio.new_event_loop}
