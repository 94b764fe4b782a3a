"""``python -m kvmesh.adapters.sglang <sglang launch_server arguments> [--kvmesh-* flags]``.

Behaves like ``python -m sglang.launch_server`` with the same arguments (same parser, same run
path, same exit codes, child processes killed at exit), plus:

1. kvmesh's own flags are taken out first (SGLang's parser refuses unknown flags) and become the
   ``KVMESH_*`` variables every process (and every tokenizer worker) reads:
   ``--kvmesh-workers URLS``, ``--kvmesh-self-url URL``, ``--kvmesh-config PATH``,
   ``--kvmesh-admin-token TOKEN``, ``--kvmesh-events-port PORT`` (default 5557);
2. SGLang's plugins are loaded (kvmesh's entry point registers the ``kvmesh`` publisher and the
   scheduler hooks) and kvmesh's plugin is registered directly too, so a kvmesh that is on the
   path but not installed still works;
3. without ``--kv-events-config`` one is added: the ``kvmesh`` publisher on
   ``tcp://*:PORT`` (``PORT + rank`` per DP rank) with replay on ``PORT + dp_size`` and up, so the
   two ranges never collide;
4. kvmesh is mounted on SGLang's app (:func:`.app.mount`), and with ``--tokenizer-worker-num > 1``
   ``SGLANG_HTTP_SERVER_APP_PATH`` names :mod:`.app`, which mounts it in every worker;
5. without ``--enable-priority-scheduling`` a loud warning says request priorities are ignored;
6. with ``--enable-metrics``, Prometheus's multiprocess directory is set up before kvmesh imports
   ``prometheus_client`` (:func:`share_metrics_dir`).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import warnings
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

from kvmesh.adapters.sglang._sglang import import_sglang
from kvmesh.adapters.sglang.backend import PRIORITY_WARNING
from kvmesh.adapters.sglang.control import CONTROL_ENV
from kvmesh.adapters.sglang.publisher import DP_SIZE_ENV, PUBLISHER_NAME
from kvmesh.errors import ConfigError, EngineMissing

logger = logging.getLogger("kvmesh.adapters.sglang")

KVMESH_FLAGS = {
    "--kvmesh-workers": "KVMESH_WORKERS",
    "--kvmesh-self-url": "KVMESH_SELF_URL",
    "--kvmesh-config": "KVMESH_CONFIG",
    "--kvmesh-admin-token": "KVMESH_ADMIN_TOKEN",
    "--kvmesh-events-port": None,
}
DEFAULT_EVENTS_PORT = 5557
APP_PATH = "kvmesh.adapters.sglang.app:app"
METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"

_metrics_dir: tempfile.TemporaryDirectory[str] | None = None
"""The directory :func:`share_metrics_dir` made, kept for the life of the process."""


def split_argv(argv: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """kvmesh's flags (``--flag value`` or ``--flag=value``) and the rest, in order, for SGLang."""
    ours: dict[str, str] = {}
    rest: list[str] = []
    items = list(argv)
    i = 0
    while i < len(items):
        arg = items[i]
        name, eq, value = arg.partition("=")
        if name in KVMESH_FLAGS:
            if not eq:
                if i + 1 >= len(items):
                    raise ConfigError(f"{name} needs a value")
                value = items[i + 1]
                i += 1
            ours[name] = value
        elif arg.startswith("--kvmesh-"):
            raise ConfigError(f"unknown kvmesh flag {name}; known: {', '.join(sorted(KVMESH_FLAGS))}")
        else:
            rest.append(arg)
        i += 1
    return ours, rest


def _flag_value(argv: Sequence[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg[len(flag) + 1 :]
    return None


def with_kv_events(argv: list[str], port: int) -> list[str]:
    """``argv`` plus a ``--kv-events-config`` for kvmesh's publisher when it has none."""
    if _flag_value(argv, "--kv-events-config") is not None:
        return argv
    dp_text = _flag_value(argv, "--dp-size") or _flag_value(argv, "--dp") or "1"
    # (anything but a count is SGLang's own parser's to refuse, naming its flag: int() here was a
    # ValueError traceback before it)
    dp = int(dp_text) if dp_text.isascii() and dp_text.isdigit() and len(dp_text) <= 6 else 1
    dp = max(dp, 1)
    last = port + 2 * dp - 1  # a live and a replay port a rank
    if last > 65535:
        raise ConfigError(
            f"--kvmesh-events-port {port} with {dp} data-parallel rank(s) needs ports {port} to {last} "
            "(a live and a replay port a rank), past 65535"
        )
    config = {
        "publisher": PUBLISHER_NAME,
        "endpoint": f"tcp://*:{port}",
        "replay_endpoint": f"tcp://*:{port + dp}",
    }
    return [*argv, "--kv-events-config", json.dumps(config)]


def share_metrics_dir(server_args: Any, env: MutableMapping[str, str]) -> None:
    """With ``--enable-metrics``, give the process Prometheus's multiprocess directory now.

    SGLang's ``/metrics`` serves only what its processes write to that directory, and
    ``prometheus_client`` decides whether a process writes there when it is first imported. SGLang
    sets the directory up at launch, after this module has mounted kvmesh, whose middleware imports
    ``prometheus_client``: without this, every metric the HTTP server's process made afterwards
    (SGLang's tokenizer manager's and kvmesh's own) stayed in memory and never reached
    ``/metrics``. SGLang finds the variable set and uses it as a user's own.
    """
    global _metrics_dir
    if not getattr(server_args, "enable_metrics", False) or env.get(METRICS_DIR_ENV):
        return
    if "prometheus_client" in sys.modules:
        logger.warning(
            "kvmesh: prometheus_client was imported before SGLang's launch, so this process's "
            "metrics will not reach /metrics; set %s before starting the server",
            METRICS_DIR_ENV,
        )
    _metrics_dir = tempfile.TemporaryDirectory(prefix="kvmesh-sglang-metrics-")
    env[METRICS_DIR_ENV] = _metrics_dir.name


def check_settings(env: Mapping[str, str]) -> None:
    """Read kvmesh's settings now, as SGLang's processes will: ConfigError naming the variable.

    The middleware reads them when SGLang's HTTP server starts and the scheduler processes read the
    pin budget as they start, both after the model has loaded: a wrong ``--kvmesh-workers`` was
    said only after minutes of loading, by a traceback."""
    from kvmesh.router.mesh.settings import MeshSettings, mesh_configured
    from kvmesh.worker.retention import pin_budget_from_env

    pin_budget_from_env(env)
    if mesh_configured(env):  # (what mounts the middleware)
        MeshSettings.load(env)


def prepare(argv: Sequence[str], environ: dict[str, str] | None = None) -> Any:
    """Everything before the server runs: returns SGLang's ``ServerArgs`` with kvmesh mounted."""
    env = os.environ if environ is None else environ
    ours, rest = split_argv(argv)
    for flag, var in KVMESH_FLAGS.items():
        if var is not None and flag in ours:
            env[var] = ours[flag]
    port_text = ours.get("--kvmesh-events-port", str(DEFAULT_EVENTS_PORT))
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ConfigError(f"--kvmesh-events-port must be a tcp port, got {port_text!r}")
    check_settings(env)

    import_sglang()
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    from kvmesh.adapters.sglang import plugin

    load_plugins()
    plugin.register()
    from sglang.srt.plugins.hook_registry import HookRegistry

    HookRegistry.apply_hooks()  # kvmesh's hooks, when its entry point is not installed

    server_args = prepare_server_args(with_kv_events(rest, int(port_text)))
    env[DP_SIZE_ENV] = str(int(getattr(server_args, "dp_size", 1) or 1))
    env.setdefault(CONTROL_ENV, f"ipc://{tempfile.gettempdir()}/kvmesh-sglang-{os.getpid()}")
    if not getattr(server_args, "enable_priority_scheduling", False):
        logger.warning(PRIORITY_WARNING)
        print(f"WARNING {PRIORITY_WARNING}", file=sys.stderr)

    share_metrics_dir(server_args, env)
    from sglang.srt.entrypoints import http_server

    from kvmesh.adapters.sglang.app import mount

    mount(http_server.app, server_args)
    if int(getattr(server_args, "tokenizer_worker_num", 1) or 1) > 1:
        env["SGLANG_HTTP_SERVER_APP_PATH"] = APP_PATH
    return server_args


def main(argv: Sequence[str] | None = None) -> None:
    """Run SGLang's server the way ``python -m sglang.launch_server`` does."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        server_args = prepare(args)
    except ConfigError as e:
        print(f"kvmesh: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except EngineMissing as e:  # (a traceback before; SGLang's own import errors still show theirs)
        print(f"kvmesh: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    from sglang.launch_server import run_server
    from sglang.srt.utils import kill_process_tree

    with warnings.catch_warnings():
        warnings.simplefilter("default")
        try:
            run_server(server_args)
        finally:
            kill_process_tree(os.getpid(), include_parent=False)
