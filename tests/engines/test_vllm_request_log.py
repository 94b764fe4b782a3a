"""``KVMESH_LOG_REQUESTS`` inside a vLLM API server process: vLLM 0.33.0's own logging config gives
its ``vllm`` loggers a handler and the root logger none, so a kvmesh line at INFO went nowhere; the
request log gives itself one on stderr (kvmesh.router.asgi.request_log). Run in a fresh process that
configures logging as ``vllm serve`` does (``configure_logging`` with the default ``LoggingConfig``),
then has vLLM log a line of its own beside kvmesh's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.engine_vllm, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]

PROBE = """
import logging, time
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging, init_logger
configure_logging(LoggingConfig())  # (what `vllm serve` applies from its default arguments)
assert not logging.getLogger().handlers, logging.getLogger().handlers
init_logger("vllm.entrypoints.test").info("vllm's own line")
from kvmesh.router.asgi.request_log import log_request
log_request("POST", "/v1/chat/completions", "rejected", 400, time.perf_counter(), None, ("bad", "messages"))
"""


def test_a_request_line_reaches_stderr_beside_vllms_own() -> None:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("KVMESH_", "VLLM_LOGGING"))}
    environ["PYTHONPATH"] = str(REPO)
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=240, env=environ
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout + done.stderr
    assert "vllm's own line" in out
    lines = [x for x in out.splitlines() if "POST /v1/chat/completions 400 rejected" in x]
    assert len(lines) == 1 and "field=messages" in lines[0], out[-3000:]
