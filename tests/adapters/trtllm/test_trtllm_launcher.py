"""The launcher (kvmesh/adapters/trtllm/{argv,launcher,server}.py): argument handling, and the
whole path on the fake trtllm-serve: kvmesh's flags out, KV events merged into the YAML, the
OpenAIServer patched (either constructor name), kvmesh's router and routes served over HTTP on
loopback, the bridge feeding the embedded router's index."""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
import yaml

from kvmesh.adapters.trtllm._trtllm import import_trtllm
from kvmesh.adapters.trtllm.argv import DEFAULT_EVENT_BUFFER, prepare, split_kvmesh_flags
from kvmesh.adapters.trtllm.hints import engine_priority
from kvmesh.errors import ConfigError
from kvmesh.router.mesh.metrics import get_metrics
from tests.events.eventkit import free_tcp_port
from tests.router.servers import Loop, StreamingEngine, pinned_stream_bytes, serve


# ---------------------------------------------------------------------------- arguments
def test_kvmesh_flags_are_taken_out_in_both_spellings() -> None:
    rest, flags = split_kvmesh_flags(
        [
            "m",
            "--port",
            "8000",
            "--kvmesh-workers",
            "http://a,http://b",
            "--kvmesh-pin-budget=0.1",
            "--host",
            "h",
        ]
    )
    assert rest == ["m", "--port", "8000", "--host", "h"]
    assert flags == {"--kvmesh-workers": "http://a,http://b", "--kvmesh-pin-budget": "0.1"}


def test_an_unknown_kvmesh_flag_is_refused() -> None:
    with pytest.raises(ConfigError, match="unknown kvmesh flag '--kvmesh-bogus'"):
        split_kvmesh_flags(["m", "--kvmesh-bogus", "1"])
    with pytest.raises(ConfigError, match="--kvmesh-self-url needs a value"):
        split_kvmesh_flags(["m", "--kvmesh-self-url"])


def _load(path: str) -> Any:
    with open(path) as f:
        return yaml.safe_load(f)


@pytest.mark.parametrize("flag", ["--config", "--extra_llm_api_options"])
def test_the_users_yaml_is_merged_with_kv_events_on(tmp_path: Path, flag: str) -> None:
    user = tmp_path / "opts.yaml"
    user.write_text(
        "max_batch_size: 8\nkv_cache_config:\n  tokens_per_block: 16\n  event_buffer_max_size: 0\n"
    )
    launch = prepare(["m", flag, str(user), "--port", "1"], environ={})
    try:
        assert launch.argv == ["m", flag, launch.config_path, "--port", "1"]
        assert _load(launch.config_path) == {  # type: ignore[arg-type]
            "max_batch_size": 8,
            "kv_cache_config": {
                "tokens_per_block": 16,
                "event_buffer_max_size": DEFAULT_EVENT_BUFFER,
                "enable_block_reuse": True,
            },
        }
        assert user.read_text().count("event_buffer_max_size: 0") == 1  # the user's file is untouched
    finally:
        Path(launch.config_path).unlink()  # type: ignore[arg-type]


def test_a_users_buffer_size_is_kept_and_a_missing_config_is_added(tmp_path: Path) -> None:
    user = tmp_path / "opts.yaml"
    user.write_text("kv_cache_config: {event_buffer_max_size: 77}\n")
    launch = prepare(["serve", "m", f"--config={user}"], environ={})
    assert launch.argv == ["serve", "m", f"--config={launch.config_path}"]
    assert _load(launch.config_path)["kv_cache_config"]["event_buffer_max_size"] == 77  # type: ignore[arg-type]
    launch = prepare(["m"], environ={})
    assert launch.argv == ["m", "--extra_llm_api_options", launch.config_path]
    assert _load(launch.config_path) == {  # type: ignore[arg-type]
        "kv_cache_config": {"enable_block_reuse": True, "event_buffer_max_size": DEFAULT_EVENT_BUFFER}
    }


def test_block_reuse_off_and_other_commands_are_refused(tmp_path: Path) -> None:
    user = tmp_path / "opts.yaml"
    user.write_text("kv_cache_config:\n  enable_block_reuse: false\n")
    with pytest.raises(ConfigError, match="enable_block_reuse is false"):
        prepare(["m", "--config", str(user)], environ={})
    with pytest.raises(ConfigError, match="'serve' command only, not 'disaggregated'"):
        prepare(["disaggregated", "-c", "x.yaml"], environ={})
    with pytest.raises(ConfigError, match="--kvmesh-pin-budget must be a fraction"):
        prepare(["m", "--kvmesh-pin-budget", "2"], environ={})
    with pytest.raises(ConfigError, match="--kvmesh-events-endpoint 'tcp://\\*:70000' has port '70000'"):
        prepare(["m", "--kvmesh-events-endpoint", "tcp://*:70000"], environ={})
    with pytest.raises(ConfigError, match=r"--kvmesh-replay-endpoint 'tcp://10\.0\.0\.1:x' has port 'x'"):
        prepare(["m", "--kvmesh-replay-endpoint", "tcp://10.0.0.1:x"], environ={})


def test_ports_the_attention_dp_ranks_would_share_are_refused_before_the_model_loads(tmp_path: Path) -> None:
    """Rank r binds the events port + r and the replay port + r once the model has loaded; ranges
    that collide (5557 and 5558 with two ranks, the old default) stopped the server then. Said now,
    with the ranks read as the engine reads them: the YAML's tensor-parallel size over the flag's."""
    user = tmp_path / "opts.yaml"
    user.write_text("enable_attention_dp: true\n")
    ports = ["--kvmesh-events-endpoint", "tcp://*:5557", "--kvmesh-replay-endpoint", "tcp://*:5560"]
    prepare(["m", "--tp_size", "3", "--config", str(user), *ports], environ={})  # (3 ranks fit)
    with pytest.raises(ConfigError, match=r"5557 \(events\) and 5560 \(replay\) overlap over 4 attention"):
        prepare(["m", "--tp_size", "4", "--config", str(user), *ports], environ={})
    user.write_text("enable_attention_dp: true\ntensor_parallel_size: 8\n")
    with pytest.raises(ConfigError, match=r"overlap over 8 attention-DP ranks"):
        prepare(["m", "--tp_size", "2", "--config", str(user), *ports], environ={})
    user.write_text("enable_attention_dp: false\ntensor_parallel_size: 8\n")
    prepare(["m", "--config", str(user), *ports], environ={})  # (one rank without attention DP)
    user.write_text("enable_attention_dp: true\ntensor_parallel_size: 8\n")
    prepare(["m", "--config", str(user)], environ={})  # (the defaults, 5557 and 5567, fit ten)
    # newer trtllm-serve takes the switch as a flag too; the YAML, when it says, overwrites it
    with pytest.raises(ConfigError, match=r"overlap over 4 attention-DP ranks"):
        prepare(["m", "--tp_size", "4", "--enable_attention_dp", *ports], environ={})
    user.write_text("kv_cache_config:\n  free_gpu_memory_fraction: 0.8\n")
    with pytest.raises(ConfigError, match=r"overlap over 4 attention-DP ranks"):
        prepare(["m", "--enable_attention_dp", "--tp_size=4", "--config", str(user), *ports], environ={})
    user.write_text("enable_attention_dp: false\n")
    prepare(["m", "--tp_size", "4", "--enable_attention_dp", "--config", str(user), *ports], environ={})


def test_kvmesh_settings_are_read_before_trtllm_serve_loads_the_model(tmp_path: Path) -> None:
    """The middleware reads them when trtllm-serve builds its server, after the model has loaded: a
    wrong one was said minutes in. (Nothing is left behind: the merged YAML is written after.)"""
    before = set(Path(tempfile.gettempdir()).glob("kvmesh-trtllm-*.yaml"))
    with pytest.raises(ConfigError, match="worker URL 'ftp://x' must look like http://host:port"):
        prepare(["m", "--kvmesh-workers", "ftp://x"], environ={})
    with pytest.raises(ConfigError, match="KVMESH_ROUTER_TEMPERATURE must be a number, got 'hot'"):
        prepare(["m"], environ={"KVMESH_ROUTER_TEMPERATURE": "hot"})
    assert set(Path(tempfile.gettempdir()).glob("kvmesh-trtllm-*.yaml")) == before


def test_environment_and_options_from_flags() -> None:
    launch = prepare(
        [
            "/models/llama",
            "--tokenizer",
            "/models/tok",
            "--kvmesh-self-url",
            "http://h:1",
            "--kvmesh-events-endpoint",
            "tcp://*:6000",
            "--kvmesh-replay-endpoint",
            "none",
            "--kvmesh-advertise-host",
            "gpu-3",
        ],
        environ={},
    )
    assert launch.env == {"KVMESH_SELF_URL": "http://h:1", "KVMESH_TOKENIZER": "/models/tok"}
    assert launch.options.events_endpoint == "tcp://*:6000"
    assert launch.options.replay_endpoint is None
    assert launch.options.advertise_host == "gpu-3"
    assert prepare(["/models/llama"], environ={}).env == {"KVMESH_TOKENIZER": "/models/llama"}
    assert prepare(["/models/llama"], environ={"KVMESH_TOKENIZER": "builtin"}).env == {}


def test_a_missing_tensorrt_llm_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)
    with pytest.raises(ImportError, match=r"pip install 'kvmesh\[trtllm\]'"):
        import_trtllm("tensorrt_llm.commands.serve")


def test_importing_the_adapter_does_not_import_tensorrt_llm(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)
    for name in [m for m in sys.modules if m.startswith("kvmesh.adapters.trtllm")]:
        monkeypatch.delitem(sys.modules, name)
    for module in ("", ".launcher", ".server", ".backend", ".bridge", ".retention", ".hints", ".argv"):
        importlib.import_module("kvmesh.adapters.trtllm" + module)


# ---------------------------------------------------------------------------- the whole path
class Running:
    def __init__(
        self, url: str, serve_module: ModuleType, thread: threading.Thread, result: dict[str, Any]
    ) -> None:
        self.url = url
        self.serve = serve_module
        self.thread = thread
        self.result = result
        self.http = httpx.Client(base_url=url, timeout=10)

    def wait(self, what: Any, timeout: float = 15.0) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = what()
            except httpx.TransportError:
                value = None
            if value:
                return value
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise AssertionError("the condition did not hold in time")
            time.sleep(0.02)


@pytest.fixture
def launched(
    fake_trtllm: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> Iterator[Running]:
    from tensorrt_llm.commands import serve as serve_module
    from tensorrt_llm.llmapi import LLMWithPriority
    from tensorrt_llm.serve import openai_server

    param = getattr(request, "param", {})
    peer: str | None = request.getfixturevalue("streaming_peer").url if param.get("peer") else None
    if param.get("priority"):
        monkeypatch.setattr(serve_module, "LLM_CLASS", LLMWithPriority)
    monkeypatch.setattr(openai_server.OpenAIServer, "FIRST_ARG", param.get("first_arg", "generator"))
    port = free_tcp_port()
    url = f"http://127.0.0.1:{port}"
    for key in ("KVMESH_WORKERS", "KVMESH_CONFIG", "KVMESH_ADMIN_TOKEN", "KVMESH_ROUTER_KV_EVENTS"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("KVMESH_TOKENIZER", "builtin")
    monkeypatch.setenv("KVMESH_SELF_URL", url)  # the launcher sets it from its flag; restored after
    user = tmp_path / "opts.yaml"
    user.write_text("kv_cache_config:\n  tokens_per_block: 4\n")
    argv = [
        "fake-model",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--config",
        str(user),
        "--kvmesh-self-url",
        url,
        "--kvmesh-events-endpoint",
        "tcp://127.0.0.1:0",
        "--kvmesh-replay-endpoint",
        "tcp://127.0.0.1:0",
    ]
    if peer is not None:  # a fleet of two, routed on what the router saw (the peer has no events)
        argv += ["--kvmesh-workers", f"{url},{peer}"]
        monkeypatch.setenv("KVMESH_ROUTER_KV_EVENTS", "false")
    from kvmesh.adapters.trtllm.launcher import main

    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.update(code=main(argv)), daemon=True)
    thread.start()
    running = Running(url, serve_module, thread, result)
    running.wait(lambda: running.http.get("/health").status_code == 200)
    yield running
    running.http.close()
    for server in openai_server.RUNNING:
        server.should_exit = True
    thread.join(10)
    assert result == {"code": 0}
    assert not Path(serve_module.LAST["config_path"]).exists()  # the merged YAML is cleaned up


def _completion(r: Running, **extra: Any) -> dict[str, Any]:
    body = {"model": "fake-model", "prompt": "hello there, general kenobi", "max_tokens": 2, **extra}
    response = r.http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


@pytest.mark.parametrize("launched", [{"first_arg": "generator"}, {"first_arg": "llm"}], indirect=True)
def test_trtllm_serve_runs_with_kvmesh_inside(launched: Running) -> None:
    r = launched
    llm = r.serve.LAST["llm"]
    assert llm.events_enabled  # the merged YAML reached the engine
    info = r.http.get("/kvmesh/info").json()
    assert (info["backend"], info["block_size"], info["dp_size"], info["priority_polarity"]) == (
        "trtllm",
        4,
        1,
        "none",
    )
    first = _completion(r, nvext={"agent_hints": {"priority": 5}})
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    second = _completion(r)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert llm.calls[0]["priority"] is None  # this engine has no request priority
    # The embedded router follows the bridge's ZMQ stream and indexes the blocks.
    workers = r.wait(
        lambda: (w := r.http.get("/kvmesh/workers").json()["workers"]) and w[0]["indexed_blocks"] > 0 and w
    )
    assert workers[0]["local"] is True and workers[0]["backend"] == "trtllm"
    state = r.http.get("/kvmesh/kv_state").json()
    stored = {h for rank in state["ranks"] for e in rank["events"] for h in e["block_hashes"]}
    assert len(stored) == workers[0]["indexed_blocks"]
    # trtllm-serve's own endpoint still hands out every raw event, once.
    events = r.http.post("/kv_cache_events").json()
    assert [e["data"]["type"] for e in events][:2] == ["created", "stored"]
    assert r.http.post("/kv_cache_events").json() == []
    metrics = r.http.get("/kvmesh/metrics").text
    assert "kvmesh_trtllm_events_bridged_total" in metrics


@pytest.mark.parametrize("launched", [{"priority": True}], indirect=True)
def test_priority_reaches_an_engine_that_has_it(launched: Running) -> None:
    r = launched
    r.wait(lambda: r.http.get("/kvmesh/workers").json()["workers"][0]["priority_polarity"] == "higher_first")
    _completion(r, nvext={"agent_hints": {"priority": 5}})
    _completion(r)
    llm = r.serve.LAST["llm"]
    assert [c["priority"] for c in llm.calls] == [engine_priority(5), 0.5]


def test_pin_prefix_over_http(launched: Running) -> None:
    r = launched
    _completion(r)
    llm = r.serve.LAST["llm"]
    prompt = llm.calls[0]["prompt"]
    r.wait(lambda: r.http.get("/kvmesh/kv_state").json()["ranks"][0]["events"])
    answer = r.http.post("/kvmesh/pin_prefix", json={"token_ids": prompt, "ttl_seconds": 30})
    assert answer.status_code == 200, answer.text
    pinned = answer.json()["blocks_pinned"]
    assert pinned == (len(prompt) - 1) // 4
    claim = r.wait(lambda: next((c for c in llm.calls if c["kv_cache_retention_config"]), None))
    (rng,) = claim["kv_cache_retention_config"].token_range_retention_configs
    assert (rng.token_start, rng.token_end, rng.priority) == (0, pinned * 4, 100)
    assert json.dumps(r.http.post("/kvmesh/reset_prefix_cache").json()).count("no prefix-cache reset") == 1


class Peer:
    """A raw streaming engine served on loopback by an event loop of its own (the launcher runs
    trtllm-serve's loop on another thread)."""

    def __init__(self, loop: Loop) -> None:
        self.engine = StreamingEngine(events=24)
        self.url: str = loop.enter(serve(self.engine)).url


@pytest.fixture
def streaming_peer() -> Iterator[Peer]:
    loop = Loop()
    try:
        yield Peer(loop)
    finally:
        loop.close()


@pytest.mark.parametrize("launched", [{"peer": True}], indirect=True)
def test_a_peers_streamed_answer_is_relayed_from_the_socket_callback_inside_trtllm_serve(
    launched: Running, streaming_peer: Peer
) -> None:
    """trtllm-serve serves its app with uvicorn, on httptools where it is installed (kvmesh
    requires it); kvmesh's middleware is the outermost layer the launcher adds, so a peer's tokens
    go to the client from the worker connection's callback (``direct_relay``), byte for byte."""
    r = launched
    r.wait(lambda: [w["state"] for w in r.http.get("/kvmesh/workers").json()["workers"]] == ["up", "up"])
    direct = get_metrics().relayed_chunks["direct"]
    before = direct._value.get()

    async def stream() -> bytes:
        async with httpx.AsyncClient(base_url=r.url, timeout=30) as http:
            return await pinned_stream_bytes(http, streaming_peer.url, "fake-model")

    received = asyncio.run(stream())
    assert received == streaming_peer.engine.sent
    assert direct._value.get() - before >= 12
