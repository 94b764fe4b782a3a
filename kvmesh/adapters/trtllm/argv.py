"""The launcher's command line: kvmesh's own flags out, KV events in, the rest to trtllm-serve.

``python -m kvmesh.adapters.trtllm <trtllm-serve arguments> [--kvmesh-* flags]``:

* ``--kvmesh-*`` flags (anywhere, ``--flag value`` or ``--flag=value``) are kvmesh's and are
  removed; an unknown one is an error, not passed on. ``--kvmesh-workers``, ``--kvmesh-self-url``,
  ``--kvmesh-config``, ``--kvmesh-admin-token`` and ``--kvmesh-tokenizer`` set the ``KVMESH_*``
  variables the embedded router reads; the others configure the adapter (:class:`WorkerOptions`).
* KV events: TensorRT-LLM publishes them only with ``kv_cache_config.event_buffer_max_size > 0``
  and ``enable_block_reuse: true``. Both live in the LLM-API YAML that trtllm-serve takes as
  ``--config`` or ``--extra_llm_api_options`` (aliases from 1.2 on; 1.0/1.1 know only the second).
  The launcher reads the user's file if there is one, sets ``event_buffer_max_size`` when it is
  missing or 0, refuses ``enable_block_reuse: false`` (without reuse there is no prefix cache to
  route to), writes the merged YAML to a temporary file and points the flag at it.
* Only trtllm-serve's ``serve`` command (also its default) can be wrapped; ``disaggregated``,
  ``grpc`` and the others are refused.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

from kvmesh.adapters.trtllm.backend import WorkerOptions
from kvmesh.adapters.trtllm.bridge import check_rank_ports
from kvmesh.adapters.trtllm.retention import check_budget
from kvmesh.errors import ConfigError
from kvmesh.events.endpoint import check_endpoint
from kvmesh.router.mesh.settings import MeshSettings

DEFAULT_EVENT_BUFFER = 1024
CONFIG_FLAGS = ("--config", "--extra_llm_api_options")
OTHER_COMMANDS = ("disaggregated", "disaggregated_mpi_worker", "grpc", "mm_embedding_serve")

_ENV_FLAGS = {
    "--kvmesh-workers": "KVMESH_WORKERS",
    "--kvmesh-self-url": "KVMESH_SELF_URL",
    "--kvmesh-config": "KVMESH_CONFIG",
    "--kvmesh-admin-token": "KVMESH_ADMIN_TOKEN",
    "--kvmesh-tokenizer": "KVMESH_TOKENIZER",
}
_OPTION_FLAGS = (
    "--kvmesh-events-endpoint",
    "--kvmesh-replay-endpoint",
    "--kvmesh-pin-budget",
    "--kvmesh-advertise-host",
)


@dataclass
class Launch:
    """What the launcher will do: trtllm-serve's arguments, kvmesh's environment and options."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    options: WorkerOptions = field(default_factory=WorkerOptions)
    config_path: str | None = None
    """The merged YAML the launcher wrote (the caller removes it when trtllm-serve exits)."""


def split_kvmesh_flags(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """(trtllm-serve's arguments, {kvmesh flag: value})."""
    rest: list[str] = []
    flags: dict[str, str] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--kvmesh-"):
            rest.append(arg)
            i += 1
            continue
        name, eq, value = arg.partition("=")
        if name not in _ENV_FLAGS and name not in _OPTION_FLAGS:
            known = ", ".join(sorted([*_ENV_FLAGS, *_OPTION_FLAGS]))
            raise ConfigError(f"unknown kvmesh flag {name!r}; kvmesh's flags are: {known}")
        if not eq:
            if i + 1 >= len(argv):
                raise ConfigError(f"{name} needs a value")
            value = argv[i + 1]
            i += 1
        flags[name] = value
        i += 1
    return rest, flags


def options_from_flags(flags: dict[str, str]) -> WorkerOptions:
    kwargs: dict[str, Any] = {}
    if "--kvmesh-events-endpoint" in flags:
        kwargs["events_endpoint"] = _endpoint(flags, "--kvmesh-events-endpoint")
    if "--kvmesh-replay-endpoint" in flags:
        value = flags["--kvmesh-replay-endpoint"]
        off = value.lower() in ("", "none", "off")
        kwargs["replay_endpoint"] = None if off else _endpoint(flags, "--kvmesh-replay-endpoint")
    if "--kvmesh-pin-budget" in flags:
        text = flags["--kvmesh-pin-budget"]
        try:
            kwargs["pin_budget"] = check_budget(float(text))
        except ValueError:
            raise ConfigError(
                f"--kvmesh-pin-budget must be a fraction between 0 and 1, got {text!r}"
            ) from None
    if "--kvmesh-advertise-host" in flags:
        kwargs["advertise_host"] = flags["--kvmesh-advertise-host"]
    return WorkerOptions(**kwargs)


def _endpoint(flags: dict[str, str], name: str) -> str:
    """An endpoint flag, checked at launch (the bridge binds it inside trtllm-serve, where a port
    past 65535 would have been refused only once the engine was up)."""
    return check_endpoint(flags[name], bind=True, what=name)


def _find_config(argv: list[str]) -> tuple[int, str, str | None]:
    """(index of the last config flag or -1, the flag's spelling, its value)."""
    found: tuple[int, str, str | None] = (-1, "--extra_llm_api_options", None)
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name in CONFIG_FLAGS:
            if eq:
                found = (i, name, value)
            elif i + 1 < len(argv):
                found = (i, name, argv[i + 1])
            else:
                raise ConfigError(f"{name} needs a value")
    return found


def merge_kv_events(config: dict[str, Any] | None) -> dict[str, Any]:
    """The LLM-API options with KV events on: a copy, the user's values kept where they allow it."""
    merged = dict(config or {})
    kv = merged.get("kv_cache_config")
    kv = dict(kv) if isinstance(kv, dict) else {}
    if kv.get("enable_block_reuse") is False:
        raise ConfigError(
            "kv_cache_config.enable_block_reuse is false in the trtllm-serve config: kvmesh routes to "
            "cached prefixes, which TensorRT-LLM keeps only with block reuse on; remove that setting"
        )
    kv["enable_block_reuse"] = True
    if not kv.get("event_buffer_max_size"):
        kv["event_buffer_max_size"] = DEFAULT_EVENT_BUFFER
    merged["kv_cache_config"] = kv
    return merged


def prepare(argv: list[str], environ: dict[str, str] | None = None) -> Launch:
    """Split and rewrite the launcher's arguments (writes the merged YAML; nothing else runs)."""
    import yaml  # TensorRT-LLM's own dependency; trtllm-serve reads the same file with it

    env = os.environ if environ is None else environ
    rest, flags = split_kvmesh_flags(argv)
    if rest and rest[0] in OTHER_COMMANDS:
        raise ConfigError(f"kvmesh wraps trtllm-serve's 'serve' command only, not {rest[0]!r}")
    launch_env = {_ENV_FLAGS[k]: v for k, v in flags.items() if k in _ENV_FLAGS}
    configured = {**env, **launch_env}
    # The middleware reads these when trtllm-serve builds its server, after the model has loaded:
    # a wrong one was said minutes in. Read them now.
    MeshSettings.load(configured)
    index, flag, path = _find_config(rest)
    user: Any = None
    if path is not None:
        try:
            with open(path) as f:
                user = yaml.safe_load(f)
        except OSError as e:
            raise ConfigError(f"cannot read {flag} {path}: {e}") from None
        if user is not None and not isinstance(user, dict):
            raise ConfigError(f"{flag} {path} must hold a YAML mapping")
    merged = merge_kv_events(user)
    options = options_from_flags(flags)
    # The bridge binds a PUB and a replay port per attention-DP rank once the model has loaded:
    # ranges that collide would stop the server then. Said now, from the same arguments.
    check_rank_ports(options.events_endpoint, options.replay_endpoint, attention_dp_ranks(rest, merged))
    fd, merged_path = tempfile.mkstemp(prefix="kvmesh-trtllm-", suffix=".yaml")
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(merged, f, sort_keys=False)
    if index < 0:
        rest = [*rest, flag, merged_path]
    elif "=" in rest[index]:
        rest = [*rest[:index], f"{flag}={merged_path}", *rest[index + 1 :]]
    else:
        rest = [*rest[:index], flag, merged_path, *rest[index + 2 :]]
    if "KVMESH_TOKENIZER" not in configured and "KVMESH_CONFIG" not in configured:
        tokenizer = _served_tokenizer(rest)
        if tokenizer is not None:
            launch_env["KVMESH_TOKENIZER"] = tokenizer
    return Launch(rest, launch_env, options, merged_path)


def attention_dp_ranks(argv: list[str], options: dict[str, Any]) -> int:
    """The attention-DP ranks trtllm-serve will run: its tensor-parallel size (the YAML's, over
    ``--tp_size`` / ``--tensor_parallel_size``) when attention DP is on, else 1, as the engine's
    ``LlmArgs`` reads them. It is on when the YAML says so, or, where the YAML is silent, when
    ``--enable_attention_dp`` is given (newer trtllm-serve has the flag; its YAML overwrites flags)."""
    enabled = options.get("enable_attention_dp")
    if enabled is None:
        enabled = "--enable_attention_dp" in argv
    if enabled is not True:
        return 1
    size: Any = options.get("tensor_parallel_size")
    if size is None:
        for i, arg in enumerate(argv):
            name, eq, value = arg.partition("=")
            if name in ("--tp_size", "--tensor_parallel_size"):
                size = value if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    try:
        return max(int(size), 1) if size is not None else 1
    except (TypeError, ValueError):
        return 1  # (trtllm-serve refuses it itself)


def _served_tokenizer(argv: list[str]) -> str | None:
    """trtllm-serve's ``--tokenizer``, else its MODEL argument: the router tokenizes like the engine."""
    args = argv[1:] if argv and argv[0] == "serve" else argv
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name == "--tokenizer":
            return value if eq else (args[i + 1] if i + 1 < len(args) else None)
    return args[0] if args and not args[0].startswith("-") else None
