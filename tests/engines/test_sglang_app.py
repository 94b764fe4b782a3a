"""kvmesh's routes on SGLang 0.5.23's real FastAPI ``app`` (Starlette's TestClient, no uvicorn).

The app is SGLang's module global, with SGLang's own ``--api-key`` middleware added the way its
server adds it at start-up (after kvmesh's, so it runs first). What needs a model, the
TokenizerManager, is a recorder of the calls kvmesh makes to it (open/close session, flush): a
real one needs a model's config and tokenizer, which this machine cannot download. The scheduler
end of ``pin_prefix`` is a real RadixCache behind kvmesh's real control socket.
"""

from __future__ import annotations

import os
import threading
import types
from typing import Any

import pytest

from tests.engines import sglang_env

pytestmark = [
    pytest.mark.engine_sglang,
    pytest.mark.timeout(300),
    # SGLang 0.5.23 answers with FastAPI's ORJSONResponse, which this FastAPI deprecates: not ours.
    pytest.mark.filterwarnings("ignore::DeprecationWarning:typing_extensions"),
    pytest.mark.filterwarnings("ignore:ORJSONResponse is deprecated"),
]

KEY = "sk-test"


class RecordingTokenizerManager:
    """The TokenizerManager calls kvmesh makes, recorded; answers as SGLang's would."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.open: set[str] = set()

    async def open_session(self, obj: Any, request: Any = None) -> str | None:
        self.calls.append(("open_session", obj))
        if obj.session_id in self.open:
            return None
        self.open.add(obj.session_id)
        return str(obj.session_id)

    async def close_session(self, obj: Any, request: Any = None) -> None:
        self.calls.append(("close_session", obj))
        self.open.discard(obj.session_id)

    async def flush_cache(self, timeout_s: float | None = None) -> Any:
        self.calls.append(("flush_cache", None))

        class Out:
            success = True

        return Out()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Any:
    sglang_env.prepare()
    http_server = sglang_env.engine("sglang.srt.entrypoints.http_server")
    auth = sglang_env.engine("sglang.srt.utils.auth")
    from starlette.testclient import TestClient

    from kvmesh.adapters.sglang import launcher

    os.environ["KVMESH_SGLANG_CONTROL"] = f"ipc://{tmp_path_factory.mktemp('sglang-control')}/control"
    args = launcher.prepare(
        [
            "--model-path",
            "dummy",
            "--page-size",
            "4",
            "--api-key",
            KEY,
            "--enable-priority-scheduling",
            "--schedule-low-priority-values-first",
            "--kvmesh-events-port",
            "45557",
        ],
        environ=dict(os.environ),
    )
    tm = RecordingTokenizerManager()
    http_server.set_global_state(
        http_server._GlobalState(
            tokenizer_manager=tm, template_manager=None, scheduler_info={"max_total_num_tokens": 4096}
        )
    )
    auth.add_api_key_middleware(http_server.app, api_key=KEY, admin_api_key=None)
    client = TestClient(http_server.app)
    yield {"client": client, "tm": tm, "args": args, "app": http_server.app}
    client.close()


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def test_sglangs_api_key_guards_kvmesh_routes(served: Any) -> None:
    client = served["client"]
    assert client.get("/kvmesh/info").status_code == 401
    assert client.get("/kvmesh/info", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.get("/kvmesh/info", headers=auth()).status_code == 200


def test_info_reports_sglangs_settings_and_inverted_polarity(served: Any) -> None:
    info = served["client"].get("/kvmesh/info", headers=auth()).json()
    assert info["backend"] == "sglang"
    assert info["block_size"] == 4 and info["dp_size"] == 1
    assert info["total_kv_blocks"] == 1024
    # --schedule-low-priority-values-first: the router sends -priority
    assert info["priority_polarity"] == "lower_first"
    assert info["kv_events_endpoints"] == ["tcp://*:45557"]
    assert info["kv_replay_endpoints"] == ["tcp://*:45558"]


def test_session_control_maps_to_sglangs_native_sessions(served: Any) -> None:
    client, tm = served["client"], served["tm"]
    body = {"action": "open_session", "session_id": "s-1", "timeout": 30}
    first = client.post("/kvmesh/session_control", json=body, headers=auth()).json()
    again = client.post("/kvmesh/session_control", json=body, headers=auth()).json()
    closed = client.post(
        "/kvmesh/session_control", json={"action": "close_session", "session_id": "s-1"}, headers=auth()
    ).json()
    assert (first["created"], again["created"], closed["closed"]) == (True, False, True)
    kind, obj = tm.calls[0]
    assert kind == "open_session" and obj.session_id == "s-1" and obj.timeout == 30
    assert tm.calls[-1][0] == "close_session" and tm.calls[-1][1].session_id == "s-1"


def test_pin_prefix_reaches_the_schedulers_radix_cache(served: Any) -> None:
    """The HTTP route -> control socket -> the scheduler hook draining it, over a real RadixCache."""
    from kvmesh.adapters.sglang import scheduler_hooks
    from kvmesh.adapters.sglang.control import ControlServer, control_endpoint
    from kvmesh.adapters.sglang.pins import RadixPins
    from tests.engines.test_sglang_cache import PAGE, SlotRecorder, Slots, cached_prefix, insert

    radix = sglang_env.engine("sglang.srt.mem_cache.radix_cache")
    base = sglang_env.engine("sglang.srt.mem_cache.base_prefix_cache")
    cache = radix.RadixCache.create_simulated(mock_allocator=SlotRecorder(), page_size=PAGE)

    class SG:
        pass

    sg = SG()
    sg.radix, sg.base = radix, base
    import torch

    sg.torch = torch
    insert(sg, cache, Slots(), list(range(16)))
    service = scheduler_hooks.SchedulerService(RadixPins(cache, page_size=PAGE, total_tokens=400))
    server = ControlServer(control_endpoint(os.environ["KVMESH_SGLANG_CONTROL"], 0), service.handle)
    stop = threading.Event()

    def scheduler_loop() -> None:  # the hook's part of the scheduler loop: drain between steps
        while not stop.is_set():
            server.serve_pending()
            stop.wait(0.005)

    loop = threading.Thread(target=scheduler_loop)
    loop.start()
    try:
        answer = served["client"].post(
            "/kvmesh/pin_prefix", json={"token_ids": list(range(20)), "ttl_seconds": 60}, headers=auth()
        )
    finally:
        stop.set()
        loop.join()
        server.close()
    assert answer.status_code == 200 and answer.json()["blocks_pinned"] == 4
    cache.evict(base.EvictParams(num_tokens=10_000))
    assert cached_prefix(sg, cache, list(range(16))) == 16


def test_reset_prefix_cache_is_sglangs_flush(served: Any) -> None:
    response = served["client"].post("/kvmesh/reset_prefix_cache", headers=auth())
    assert response.status_code == 200 and served["tm"].calls[-1][0] == "flush_cache"


def test_sglangs_ready_answers_503_while_paused_with_no_key(served: Any) -> None:
    """The router passes over an SGLang engine whose ``GET /ready`` answers 503
    (``kvmesh.router.mesh.registry``): SGLang's own route, on its own readiness rule (not paused and
    healthy: the real TokenizerManager's methods), open without the API key as the router asks it."""
    tokenizer_manager = sglang_env.engine("sglang.srt.managers.tokenizer_manager")
    real = tokenizer_manager.TokenizerManager  # type: ignore[attr-defined]
    client, tm = served["client"], served["tm"]
    tm.gracefully_exit = False
    tm.server_status = tokenizer_manager.ServerStatus.Up  # type: ignore[attr-defined]
    tm.is_healthy = types.MethodType(real.is_healthy, tm)
    tm.is_ready = types.MethodType(real.is_ready, tm)
    try:
        tm.is_pause = False
        assert client.get("/ready").status_code == 200
        tm.is_pause = True  # (what /pause_generation sets)
        assert client.get("/ready").status_code == 503
    finally:
        tm.is_pause = False


def test_mounting_twice_adds_nothing(served: Any) -> None:
    from kvmesh.adapters.sglang.app import mount

    app = served["app"]
    paths = [getattr(r, "path", None) for r in app.router.routes]
    mount(app)
    assert [getattr(r, "path", None) for r in app.router.routes] == paths
    assert paths.count("/kvmesh/info") == 2  # (its route, and the 405 of another method)


def test_the_controls_the_router_sends_to_every_worker_are_sglangs_own(served: Any) -> None:
    """kvmesh.router.asgi.fleet_control sends SGLang's controls on with the method the client used:
    each is on SGLang's app with that method (GET and POST where SGLang takes both)."""
    from kvmesh.router.asgi import fleet_control

    methods: dict[str, set[str]] = {}
    for route in served["app"].router.routes:
        path = getattr(route, "path", None)
        if path is not None:
            methods.setdefault(path, set()).update(getattr(route, "methods", None) or ())
    sglang_posts = {
        "/pause_generation",
        "/continue_generation",
        "/update_weights_from_disk",
        "/update_weight_version",
        "/load_lora_adapter",
        "/unload_lora_adapter",
        "/begin_weight_update",
        "/end_weight_update",
        "/hicache/storage-backend/clear",
        "/add_external_corpus",
        "/remove_external_corpus",
    }
    assert sglang_posts <= set(fleet_control.POSTS)
    for path in sglang_posts:
        assert "POST" in methods[path], path
    assert "/list_external_corpora" in fleet_control.GETS and methods["/list_external_corpora"] == {"GET"}
    for path in fleet_control.EITHER:
        assert {"GET", "POST"} <= methods[path], path
    for path, asked_with in fleet_control.OTHER_METHODS.items():
        assert set(asked_with) == methods[path], path
    # the weight transfers the router refuses to fan out are SGLang's too
    for path in (
        "/init_weights_update_group",
        "/update_weights_from_distributed",
        "/update_weights_from_tensor",
        "/update_weights_from_ipc",
        "/load_lora_adapter_from_tensors",
        "/init_weights_send_group_for_remote_instance",
        "/send_weights_to_remote_instance",
        "/get_remote_instance_transfer_engine_info",
        "/remote_instance_transfer_engine_info",
        "/pd_role_switch",
    ):
        assert path in methods and path in fleet_control.PER_ENGINE, path


def test_sglangs_invocations_is_its_chat_endpoint_and_the_middleware_routes_it(served: Any) -> None:
    """SageMaker's entry point on SGLang takes a chat request (kvmesh.router.asgi.invocations routes
    it as one, and sends it on to ``/invocations``); the SGLang middleware's generation paths hold it."""
    from kvmesh.router.asgi.middleware import WITH_GENERATE
    from kvmesh.router.request.invocations import INVOCATIONS_PATH, invoked_endpoint

    route = next(r for r in served["app"].router.routes if getattr(r, "path", None) == INVOCATIONS_PATH)
    assert route.methods == {"POST"}
    (param,) = route.dependant.body_params
    assert param.field_info.annotation.__name__ == "ChatCompletionRequest"
    assert INVOCATIONS_PATH in WITH_GENERATE
    assert invoked_endpoint({"messages": [{"role": "user", "content": "hi"}]}) == "/v1/chat/completions"


def test_sglangs_ollama_api_is_routed_by_the_middleware_as_sglang_reads_it(served: Any) -> None:
    """SGLang serves Ollama's chat and generate on its app; the SGLang middleware's generation paths
    hold both, and the router reads their bodies by SGLang's own request types: a stream unless
    told not to, the messages' roles and contents as strings, the prompt with its system text."""
    from kvmesh.router.asgi.middleware import WITH_GENERATE
    from kvmesh.router.request.ollama_api import OLLAMA_CHAT_PATH, OLLAMA_GENERATE_PATH, streams

    protocol = sglang_env.engine("sglang.srt.entrypoints.ollama.protocol")
    types = {}
    for path in (OLLAMA_CHAT_PATH, OLLAMA_GENERATE_PATH):
        route = next(r for r in served["app"].router.routes if getattr(r, "path", None) == path)
        assert route.methods == {"POST"}
        (param,) = route.dependant.body_params
        types[path] = param.field_info.annotation
        assert path in WITH_GENERATE
    assert types[OLLAMA_CHAT_PATH] is protocol.OllamaChatRequest
    assert types[OLLAMA_GENERATE_PATH] is protocol.OllamaGenerateRequest
    for kind in types.values():
        assert kind.model_fields["stream"].default is True
        assert kind.model_fields["model"].is_required()
    assert streams({}) and not streams({"stream": False})
    message = protocol.OllamaMessage.model_fields
    assert message["role"].annotation is str and message["content"].annotation is str
    assert set(protocol.OllamaGenerateRequest.model_fields) >= {"prompt", "system", "options"}


def test_sglangs_scores_and_speech_are_among_the_paths_the_router_relays(served: Any) -> None:
    """SGLang's System One decisions and speech to text are POSTs on its app, and the standalone
    router relays them to one worker (kvmesh.router.asgi.pooling), speech to text as a form."""
    from kvmesh.router.asgi import pooling

    posts = {r.path for r in served["app"].router.routes if "POST" in (getattr(r, "methods", None) or ())}
    assert {"/v1/systemone", "/v1/audio/transcriptions"} <= posts
    assert {"/v1/systemone", "/v1/audio/transcriptions"} <= set(pooling.PATHS)
    assert "/v1/audio/transcriptions" in pooling.FORM_PATHS


def test_sglangs_sessions_and_vertex_route_are_what_the_router_serves(served: Any) -> None:
    """SGLang's ``/open_session`` and ``/close_session`` take GET or POST with the bodies the
    standalone router checks (kvmesh.router.asgi.sglang_sessions), and its Vertex AI route is at
    the path the router reads it at, with ``instances`` and ``parameters``
    (kvmesh.router.request.vertex_api)."""
    import msgspec

    from kvmesh.router.asgi import sglang_sessions
    from kvmesh.router.request.vertex_api import vertex_route

    io = sglang_env.engine("sglang.srt.managers.io_struct")

    def body_type(path: str) -> tuple[set[str], Any]:
        route = next(r for r in served["app"].router.routes if getattr(r, "path", None) == path)
        (param,) = route.dependant.body_params
        return route.methods, param.field_info.annotation

    def fields(kind: Any) -> dict[str, bool]:  # (its own: not those every request has, rid ...)
        common = {f.name for f in msgspec.structs.fields(io.BaseReq)}
        return {f.name: f.required for f in msgspec.structs.fields(kind) if f.name not in common}

    methods, kind = body_type(sglang_sessions.OPEN_PATH)
    assert methods == {"GET", "POST"} and kind is io.OpenSessionReqInput
    assert fields(kind) == {
        "capacity_of_str_len": True,
        "session_id": False,
        "streaming": False,
        "timeout": False,
    }
    methods, kind = body_type(sglang_sessions.CLOSE_PATH)
    assert methods == {"GET", "POST"} and kind is io.CloseSessionReqInput
    assert fields(kind) == {"session_id": True}
    methods, kind = body_type(vertex_route({}))
    assert methods == {"POST"} and kind is io.VertexGenerateReqInput
    assert fields(kind) == {"instances": True, "parameters": False}
