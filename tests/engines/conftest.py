"""Fixtures of the engine-tier tests (tests/engines/), which run inside the engine environments
built by ``scripts/engine-env.sh``.

Those environments hold the engine, kvmesh's runtime dependencies, pytest, pytest-asyncio,
pytest-timeout and httpx, nothing else, so this file imports only the standard library, pytest,
zmq, kvmesh and ``tests/events/eventkit.py`` (on pytest's ``pythonpath``; it needs no more). The
core run collects these files too (and deselects the tests by marker), so the engines are
imported only inside fixtures, and an engine that does not import fails the test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.events import eventkit


@pytest.fixture
def ipc_endpoint(tmp_path: Path) -> Callable[[str], str]:
    def make(name: str) -> str:
        return eventkit.ipc_endpoint(tmp_path, name)

    return make


@pytest.fixture(autouse=True)
def no_leaked_sockets() -> Iterator[None]:
    """Fail a test that leaves a ZMQ socket open (the engines' publishers close theirs on shutdown)."""
    with eventkit.no_sockets_left_open():
        yield


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """The engine tier never skips silently: a skipped engine test fails the run."""
    skipped = terminalreporter.stats.get("skipped", [])
    if skipped:
        terminalreporter.write_line(
            f"engine tier: {len(skipped)} test(s) skipped; that is a failure here", red=True
        )
        config._kvmesh_engine_skips = len(skipped)  # type: ignore[attr-defined]


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    skipped = session.config.pluginmanager.get_plugin("terminalreporter")
    if skipped is not None and skipped.stats.get("skipped") and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    session.config._kvmesh_exitstatus = session.exitstatus  # type: ignore[attr-defined]


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Leave without the interpreter's native teardown once SGLang's launcher code has run.

    After every SGLang launcher test has passed and pytest has printed its summary, the process
    segfaults in interpreter finalisation with no Python frame on the stack (SGLang 0.5.23 on CPU
    loads tvm_ffi, sentencepiece and lxml extensions; the crash follows its ``prepare_server_args``
    + ``load_plugins`` path). It never happens in a test, only after them. The exit status is
    pytest's own, so a failure still fails the run."""
    import os
    import sys

    if "sglang.srt.server_args" not in sys.modules:
        return
    session_status = getattr(config, "_kvmesh_exitstatus", None)
    if session_status is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(session_status))
