"""vLLM discovers kvmesh through its own plugin loaders (real vLLM 0.33.0 code, CPU)."""

from __future__ import annotations

import configparser
import warnings
from pathlib import Path

import pytest
import tomllib

with warnings.catch_warnings():
    # Importing vLLM imports torch, whose import-time deprecation warnings are not ours to fix.
    warnings.simplefilter("ignore", DeprecationWarning)
    import vllm.plugins as vllm_plugins
    from pydantic import TypeAdapter, ValidationError
    from vllm.config.kv_events import KVEventsConfig
    from vllm.distributed.kv_events import EventPublisherFactory
    from vllm.plugins.endpoint_plugins.interface import EndpointPlugin
    from vllm.v1.engine.core import EngineCore

    from kvmesh.adapters.vllm.endpoints import KvMeshEndpointPlugin
    from kvmesh.adapters.vllm.engine_rpc import kvmesh_rpc
    from kvmesh.adapters.vllm.plugin import register
    from kvmesh.adapters.vllm.publisher import KvMeshPublisher
    from kvmesh.errors import ConfigError
    from tests.engines.vllm_helpers import ENTRY_POINTS, write_dist_info

pytestmark = pytest.mark.engine_vllm

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """kvmesh's entry points visible to importlib.metadata, as after ``pip install kvmesh``."""
    write_dist_info(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(vllm_plugins, "plugins_loaded", False)


def test_the_test_dist_info_matches_pyproject() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    parser = configparser.ConfigParser()
    parser.read_string(ENTRY_POINTS)
    declared = {section: dict(parser[section]) for section in parser.sections()}
    assert declared == {k: v for k, v in project.items() if k.startswith("vllm.")}


def test_vllm_general_plugin_loader_registers_the_publisher(
    installed: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_PLUGINS", "kvmesh")
    vllm_plugins.load_general_plugins()
    assert EventPublisherFactory._registry["kvmesh"] is KvMeshPublisher
    assert EngineCore.kvmesh_rpc is kvmesh_rpc
    assert hasattr(EngineCore.add_request, "__kvmesh_wrapped__")
    # --kv-events-config is parsed with this exact pydantic call in vLLM's arg_utils.
    config = TypeAdapter(KVEventsConfig).validate_json(
        '{"enable_kv_cache_events": true, "publisher": "kvmesh"}'
    )
    assert config.publisher == "kvmesh"
    with pytest.raises(ValidationError, match="'null', 'zmq' or 'kvmesh'"):
        KVEventsConfig(publisher="nope")


def test_registration_is_idempotent(installed: None) -> None:
    """vLLM may load general plugins several times per process (API server, engine, workers)."""
    register()
    wrapped = EngineCore.add_request
    vllm_plugins.load_general_plugins()
    register()
    assert EngineCore.add_request is wrapped
    assert not hasattr(wrapped.__kvmesh_wrapped__, "__kvmesh_wrapped__")  # wrapped exactly once
    assert list(EventPublisherFactory._registry).count("kvmesh") == 1


def test_vllm_endpoint_plugin_loader_returns_kvmesh_only_when_allowlisted(
    installed: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    assert vllm_plugins.load_endpoint_plugins(("generate",)) == []
    monkeypatch.setenv("VLLM_PLUGINS", "kvmesh")
    [plugin] = vllm_plugins.load_endpoint_plugins(("generate",))
    assert isinstance(plugin, KvMeshEndpointPlugin)
    assert plugin.name == "kvmesh"
    # A server that cannot generate (e.g. pooling only) does not get the routes.
    assert vllm_plugins.load_endpoint_plugins(("embed",)) == []


def test_endpoint_plugin_satisfies_vllms_protocol() -> None:
    assert isinstance(KvMeshEndpointPlugin(), EndpointPlugin)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"KVMESH_WORKERS": "ftp://x"}, "worker URL 'ftp://x' must look like http://host:port"),
        ({"KVMESH_VLLM_TICK_SECONDS": "0"}, "KVMESH_VLLM_TICK_SECONDS must be a number of seconds"),
        ({"KVMESH_PIN_BUDGET": "2"}, "KVMESH_PIN_BUDGET must be a fraction between 0 and 1"),
    ],
)
def test_a_bad_kvmesh_setting_stops_vllm_as_it_loads_its_plugins(
    installed: None, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], message: str
) -> None:
    """vLLM loads general plugins in the API server before it parses its command line, and does not
    catch what they raise. The middleware, the endpoint plugin and the engine cores read these
    settings only once the model has loaded: a wrong one was said minutes in."""
    monkeypatch.setenv("VLLM_PLUGINS", "kvmesh")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=message):
        vllm_plugins.load_general_plugins()
