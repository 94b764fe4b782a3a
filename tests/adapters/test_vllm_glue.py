"""The vLLM adapter's engine-free parts, in the dev venv (no vLLM installed or needed)."""

from __future__ import annotations

import asyncio
import re
import sys
from argparse import Namespace

import pytest

from kvmesh.adapters.vllm._vllm import import_vllm
from kvmesh.adapters.vllm.endpoints import (
    KvMeshEndpointPlugin,
    VllmWorkerBackend,
    advertise_host_from_env,
    tick_seconds_from_env,
)
from kvmesh.adapters.vllm.plugin import check_settings
from kvmesh.errors import ConfigError
from kvmesh.worker.retention import pin_budget_from_env


def test_a_missing_vllm_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError, installed or not
    with pytest.raises(ImportError, match=r"pip install 'kvmesh\[vllm\]'"):
        import_vllm()


def test_importing_the_adapter_does_not_import_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--middleware kvmesh.adapters.vllm.KvMeshMiddleware`` and the entry points import these
    modules; vLLM must only be imported when a hook actually runs."""
    import importlib

    monkeypatch.setitem(sys.modules, "vllm", None)
    for name in [m for m in sys.modules if m.startswith("kvmesh.adapters.vllm")]:
        monkeypatch.delitem(sys.modules, name)
    for module in ("", ".plugin", ".endpoints", ".publisher", ".engine_rpc", ".middleware", ".tokenizer"):
        importlib.import_module("kvmesh.adapters.vllm" + module)


@pytest.mark.parametrize(
    ("env", "expected"),
    [({}, 0.25), ({"KVMESH_PIN_BUDGET": "0.5"}, 0.5), ({"KVMESH_PIN_BUDGET": "0"}, 0.0)],
)
def test_pin_budget_from_env(env: dict[str, str], expected: float) -> None:
    assert pin_budget_from_env(env) == expected


@pytest.mark.parametrize("bad", ["1.5", "-0.1", "half", "nan"])
def test_pin_budget_must_be_a_fraction(bad: str) -> None:
    with pytest.raises(
        ConfigError, match=f"KVMESH_PIN_BUDGET must be a fraction between 0 and 1, got '{bad}'"
    ):
        pin_budget_from_env({"KVMESH_PIN_BUDGET": bad})


def test_wildcard_event_endpoints_are_advertised_at_the_engines_own_host() -> None:
    # (the reader's own rules: tests/worker/test_advertise.py)
    host = advertise_host_from_env({"KVMESH_SELF_URL": "http://10.1.2.3:8000"})
    backend = VllmWorkerBackend(engine_client=None, args=Namespace(), advertise_host=host)
    assert backend._reachable("tcp://*:5557") == "tcp://10.1.2.3:5557"
    assert backend._reachable("tcp://0.0.0.0:5558") == "tcp://10.1.2.3:5558"
    assert backend._reachable("tcp://10.9.9.9:5557") == "tcp://10.9.9.9:5557"
    assert backend._reachable("ipc:///tmp/ev") == "ipc:///tmp/ev"


@pytest.mark.parametrize(("text", "expected"), [(None, 0.5), ("", 0.5), ("0.25", 0.25), ("60", 60.0)])
def test_the_retention_clock_period_from_env(text: str | None, expected: float) -> None:
    env = {} if text is None else {"KVMESH_VLLM_TICK_SECONDS": text}
    assert tick_seconds_from_env(env) == expected


@pytest.mark.parametrize("bad", ["0", "-1", "0.001", "61", "nan", "inf", "soon"])
def test_a_retention_clock_period_out_of_range_stops_the_start(
    bad: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """0 or less had the clock call every engine core as fast as the API server's event loop
    turned; a word was a bare ValueError from ``float``."""
    message = f"KVMESH_VLLM_TICK_SECONDS must be a number of seconds from 0.01 to 60, got '{bad}'"
    with pytest.raises(ConfigError, match=re.escape(message)):
        tick_seconds_from_env({"KVMESH_VLLM_TICK_SECONDS": bad})
    # vLLM's hook refuses before it makes the backend or starts the clock.
    monkeypatch.setenv("KVMESH_VLLM_TICK_SECONDS", bad)
    plugin = KvMeshEndpointPlugin()
    state = Namespace()
    with pytest.raises(ConfigError, match="KVMESH_VLLM_TICK_SECONDS"):
        asyncio.run(plugin.init_state(object(), state, Namespace()))
    assert plugin.backend is None and plugin._ticker is None
    assert not hasattr(state, "kvmesh_backend")


def test_the_settings_vllm_reads_after_the_model_loads_are_read_at_plugin_load() -> None:
    # (vLLM's own loader running it: tests/engines/test_vllm_plugins.py)
    check_settings({})
    check_settings({"KVMESH_WORKERS": "http://127.0.0.1:8000", "KVMESH_VLLM_TICK_SECONDS": "1"})
    with pytest.raises(ConfigError, match="KVMESH_ROUTER_TEMPERATURE must be a number"):
        check_settings({"KVMESH_WORKERS": "http://127.0.0.1:8000", "KVMESH_ROUTER_TEMPERATURE": "hot"})
    with pytest.raises(ConfigError, match="KVMESH_VLLM_TICK_SECONDS"):
        check_settings({"KVMESH_VLLM_TICK_SECONDS": "-1"})
