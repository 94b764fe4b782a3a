"""kvmesh's endpoint plugin and middleware on a FastAPI app wired by vLLM's own code.

vLLM's full ``build_app`` needs packages this CPU environment does not carry (and an engine with a
model), so the app is assembled from the real vLLM steps that matter here: the CLI parsed by
vLLM's ``make_arg_parser`` (``--middleware``, ``--kv-events-config`` with ``"publisher":
"kvmesh"``, ``--scheduling-policy``), ``attach_endpoint_plugins`` (phase A: vLLM's loader finds
kvmesh through its entry point), ``init_entrypoints_middleware`` (mounts ``--middleware`` exactly
as ``vllm serve`` does) and ``init_endpoint_plugins_state`` (phase B). The engine client's utility
calls run through vLLM's EngineCoreProc dispatch and codec over a real KV cache manager. vLLM's
chat handler (which needs a model) is replaced by a recorder that validates the body with vLLM's
own ``ChatCompletionRequest`` and answers like vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # torch's, at import
    import httpx
    import vllm.plugins as vllm_plugins
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse
    from vllm.distributed.kv_events import EventPublisherFactory
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.models.api_router import attach_router as attach_models_router
    from vllm.entrypoints.scale_out.factories import register_scale_out_api_routers
    from vllm.entrypoints.serve.engine.protocol import ModelCard, ModelList
    from vllm.entrypoints.serve.middleware.register import init_entrypoints_middleware
    from vllm.plugins.endpoint_plugins.interface import attach_endpoint_plugins, init_endpoint_plugins_state
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from kvmesh.adapters.vllm.endpoints import PRIORITY_WARNING, KvMeshEndpointPlugin
    from kvmesh.adapters.vllm.plugin import register
    from kvmesh.router.mesh.metrics import get_metrics
    from tests.engines.vllm_helpers import (
        BLOCK_SIZE,
        LoopbackEngineClient,
        LoopbackEngineCore,
        PromptRunner,
        make_hasher,
        make_manager,
        use_cpu_platform,
        write_dist_info,
    )
    from tests.router.servers import StreamingEngine, bound_socket, pinned_stream_bytes, serve, wait_until

pytestmark = pytest.mark.engine_vllm

TOKEN = "s3cret"


class ServedModels:
    """Stands in for vLLM's ``OpenAIServingModels`` behind vLLM's own ``/v1/models`` route: the base
    model and one LoRA adapter on it, listed as vLLM lists them."""

    async def show_available_models(self) -> ModelList:
        return ModelList(
            data=[
                ModelCard(id="tiny-model", root="tiny-model"),
                ModelCard(id="sql-lora", root="/adapters/sql", parent="tiny-model"),
            ]
        )


class Recorder:
    """Stands in for vLLM's chat handler: what reached vLLM, validated by vLLM's request model."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.session_ids: list[list[str]] = []  # every X-Session-ID header, repeats kept

    async def chat(self, request: Request) -> JSONResponse:
        assert request.app.state.args is not None  # (vLLM's handlers find their state there)
        raw = await request.body()
        parsed = ChatCompletionRequest.model_validate_json(raw)
        self.bodies.append(json.loads(raw))
        self.headers.append(dict(request.headers))
        self.session_ids.append(request.headers.getlist("x-session-id"))
        return JSONResponse(
            {
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "created": 0,
                "model": parsed.model,
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
                ],
                "usage": {
                    "prompt_tokens": 10,
                    "completion_tokens": 1,
                    "total_tokens": 11,
                    "prompt_tokens_details": {"cached_tokens": 0},
                },
            }
        )


@contextlib.asynccontextmanager
async def vllm_app(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    *,
    policy: str,
    peers: tuple[str, ...] = (),
    flags: tuple[str, ...] = (),
    tokens: Any = None,
    chat_serving: Any = None,
) -> AsyncIterator[tuple[str, Recorder, LoopbackEngineClient, PromptRunner]]:
    """``peers``: other workers of the fleet, beside this vLLM server; ``flags``: more of
    ``vllm serve``'s own; ``tokens``: what serves vLLM's token API behind vLLM's own routes for
    it (``/inference/v1/generate``, ``/inference/v1/abort_requests``; registered as ``vllm
    serve`` registers them, which answer 403 without ``--enable-scale-out``); ``chat_serving``:
    what serves chat behind vLLM's own SageMaker routes (``/invocations``, ``/ping``), which are
    then registered, and the app bootstrapped, as ``vllm serve``'s ``build_app`` does both."""
    use_cpu_platform(monkeypatch)
    write_dist_info(tmp_path / "site")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(vllm_plugins, "plugins_loaded", False)
    monkeypatch.setenv("VLLM_PLUGINS", "kvmesh")
    register()

    sock = bound_socket()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    monkeypatch.setenv("KVMESH_WORKERS", ",".join((url, *peers)))
    monkeypatch.setenv("KVMESH_SELF_URL", url)
    monkeypatch.setenv("KVMESH_ADMIN_TOKEN", TOKEN)
    monkeypatch.setenv("KVMESH_TOKENIZER", "builtin")  # vLLM's renderer needs a model config
    monkeypatch.setenv("KVMESH_BLOCK_SIZE", str(BLOCK_SIZE))

    events = json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "kvmesh",
            "endpoint": f"ipc://{tmp_path}/events",
            "replay_endpoint": f"ipc://{tmp_path}/replay",
        }
    )
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(
        [
            "--model",
            "tiny-model",
            "--middleware",
            "kvmesh.adapters.vllm.KvMeshMiddleware",
            "--scheduling-policy",
            policy,
            "--kv-events-config",
            events,
            *flags,
        ]
    )
    publisher = EventPublisherFactory.create(args.kv_events_config, data_parallel_rank=0)
    manager = make_manager(num_blocks=41)
    hasher = make_hasher()
    runner = PromptRunner(manager, hasher, publisher)
    client = LoopbackEngineClient(
        [LoopbackEngineCore(manager, hasher, publisher)], policy=policy, num_gpu_blocks=41
    )

    recorder = Recorder()
    app = FastAPI()
    app.state.args = args
    app.root_path = args.root_path  # (as vLLM's build_app sets it)
    app.add_api_route("/v1/chat/completions", recorder.chat, methods=["POST"])
    app.state.openai_serving_models = ServedModels()
    attach_models_router(app)
    if tokens is not None:
        app.state.serving_tokens = tokens
        app.state.engine_client = client
        register_scale_out_api_routers(app, ("generate",))
    if chat_serving is not None:
        from vllm.entrypoints.serve.sagemaker.api_router import attach_router as attach_sagemaker_router

        app.state.openai_serving_chat = chat_serving
        app.state.openai_serving_completion = None  # (vLLM's state names a serving it lacks)
        attach_sagemaker_router(app, ("generate",))
    attach_endpoint_plugins(app, ("generate",))
    init_entrypoints_middleware(args, app, ("generate",))
    if chat_serving is not None:
        from vllm.entrypoints.serve.sagemaker.api_router import sagemaker_standards_bootstrap

        app = sagemaker_standards_bootstrap(app)
    await init_endpoint_plugins_state(client, app.state, args)

    try:
        async with serve(app, sock):
            yield url, recorder, client, runner
    finally:
        for plugin in app.state.endpoint_plugins:
            await plugin.stop()
        publisher.shutdown()


def _auth() -> dict[str, str]:
    return {"authorization": f"Bearer {TOKEN}"}


async def test_routes_answer_on_the_vllm_app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with (
        vllm_app(tmp_path, monkeypatch, policy="priority") as (url, _, client, runner),
        httpx.AsyncClient(base_url=url, timeout=10) as http,
    ):
        info = (await http.get("/kvmesh/info", headers=_auth())).json()
        assert info == {
            "backend": "vllm",
            "model": "tiny-model",
            "block_size": BLOCK_SIZE,
            "dp_size": 1,
            "kv_events_endpoints": [f"ipc://{tmp_path}/events"],
            "kv_replay_endpoints": [f"ipc://{tmp_path}/replay"],
            "max_num_batched_tokens": 2048,
            "total_kv_blocks": 41,
            "priority_polarity": "lower_first",
            "tokens_api": False,
        }
        assert (await http.get("/kvmesh/info")).status_code == 401
        assert (await http.get("/kvmesh/info", headers={"x-kvmesh-admin-token": "wrong"})).status_code == 401

        prompt = list(range(1, 1 + 5 * BLOCK_SIZE))
        runner.run(prompt)
        reply = await http.post(
            "/kvmesh/pin_prefix", json={"token_ids": prompt, "ttl_seconds": 60}, headers=_auth()
        )
        assert reply.json() == {"status": "ok", "blocks_pinned": 5, "ttl_seconds": 60.0}
        bad = await http.post(
            "/kvmesh/pin_prefix", json={"token_ids": "x", "ttl_seconds": 60}, headers=_auth()
        )
        assert bad.status_code == 400

        state = (await http.get("/kvmesh/kv_state", headers=_auth())).json()
        assert state["block_size"] == BLOCK_SIZE
        [rank] = state["ranks"]
        assert rank["last_seq"] == runner.steps_published - 1
        assert sum(len(e["block_hashes"]) for e in rank["events"]) == 5

        opened = await http.post(
            "/kvmesh/session_control",
            json={"action": "open_session", "session_id": "s9", "timeout": 30},
            headers=_auth(),
        )
        assert opened.json()["created"] is True
        stats = client.engine_core.cores[0].call("kvmesh_rpc", "stats", {})
        assert stats == {"held_blocks": 5, "budget_blocks": 10, "holds": 2, "sessions": 1}


async def test_the_router_reads_its_own_engines_adapters_through_vllms_models_route(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The router asks its own engine in-process: vLLM's handlers read their state through the
    request's ``app``, which that request lacked, so the local engine's adapters were never known
    and its LoRA requests went only to peers."""
    async with (
        vllm_app(tmp_path, monkeypatch, policy="priority") as (url, *_),
        httpx.AsyncClient(base_url=url, timeout=10) as http,
    ):
        for _ in range(200):
            [worker] = (await http.get("/kvmesh/workers", headers=_auth())).json()["workers"]
            if worker["lora_adapters"]:
                break
            await asyncio.sleep(0.02)
        assert worker["local"] and worker["lora_adapters"] == ["sql-lora"]


async def test_a_warm_up_of_the_next_turn_reaches_vllms_own_handler_in_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``speculative_prefill`` sends the next turn's prompt to the engine that served the turn:
    here, this engine, in-process. Without the request's ``app`` it failed in vLLM's handler."""
    async with (
        vllm_app(tmp_path, monkeypatch, policy="priority") as (url, recorder, _, _),
        httpx.AsyncClient(base_url=url, timeout=10) as http,
    ):
        body = {
            "model": "tiny-model",
            "messages": [{"role": "user", "content": "hello there"}],
            "max_tokens": 1,
            "nvext": {"agent_hints": {"speculative_prefill": True}},
        }
        reply = await http.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        for _ in range(200):
            if len(recorder.bodies) == 2:
                break
            await asyncio.sleep(0.01)
        turn, warm = recorder.bodies
        assert warm["max_tokens"] == 1 and "nvext" not in warm
        assert warm["messages"] == [*turn["messages"], {"role": "assistant", "content": "ok"}]


async def test_the_middleware_sends_vllm_the_negated_priority_and_no_nvext(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with (
        vllm_app(tmp_path, monkeypatch, policy="priority") as (url, recorder, client, _),
        httpx.AsyncClient(base_url=url, timeout=10) as http,
    ):
        body = {
            "model": "tiny-model",
            "messages": [{"role": "user", "content": "hello there"}],
            "max_tokens": 1,
            "nvext": {
                "agent_hints": {"priority": 5},
                "session_control": {"session_id": "chat-7", "action": "open", "timeout": 120},
            },
        }
        reply = await http.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        [seen] = recorder.bodies
        assert "nvext" not in seen
        assert seen["priority"] == -5
        assert seen["messages"] == body["messages"]
        # vLLM's native session id, so the engine core can attribute the turn to the session:
        # once (the router's forwarding tags the turn; the adapter adds nothing of its own)
        assert recorder.session_ids == [["chat-7"]]
        # The router opened the session on the serving worker (this engine) through the plugin.
        core = client.engine_core.cores[0]
        for _ in range(100):
            if core.call("kvmesh_rpc", "stats", {})["sessions"] == 1:
                break
            await asyncio.sleep(0.02)
        assert core.call("kvmesh_rpc", "stats", {})["sessions"] == 1


async def test_under_vllms_root_path_requests_are_routed_and_the_rpcs_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``vllm serve --root-path /llm`` sets FastAPI's root path, and a path may arrive with it.
    Matched on the whole path, the middleware let such a request through unrouted (the engine got
    the nvext and no priority) and answered no ``/kvmesh/`` RPC there."""
    async with (
        vllm_app(tmp_path, monkeypatch, policy="priority", flags=("--root-path", "/llm")) as (
            url,
            recorder,
            _,
            _,
        ),
        httpx.AsyncClient(base_url=url, timeout=10) as http,
    ):
        for root in ("/llm", ""):  # asked with the root, or through a proxy that strips it
            info = await http.get(root + "/kvmesh/info", headers=_auth())
            assert info.status_code == 200 and info.json()["backend"] == "vllm"
            body = {
                "model": "tiny-model",
                "messages": [{"role": "user", "content": f"hello {root}"}],
                "max_tokens": 1,
                "nvext": {"agent_hints": {"priority": 5}},
            }
            reply = await http.post(root + "/v1/chat/completions", json=body)
            assert reply.status_code == 200, reply.text
            assert reply.headers["x-kvmesh-worker-id"] == url
            seen = recorder.bodies.pop()
            assert "nvext" not in seen and seen["priority"] == -5


async def test_without_priority_scheduling_vllm_gets_no_priority_and_a_warning_is_logged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvmesh.adapters.vllm")
    async with (
        vllm_app(tmp_path, monkeypatch, policy="fcfs") as (url, recorder, _, _),
        httpx.AsyncClient(base_url=url, timeout=10) as http,
    ):
        assert PRIORITY_WARNING in caplog.text
        body = {
            "model": "tiny-model",
            "messages": [{"role": "user", "content": "hi"}],
            "nvext": {"agent_hints": {"priority": 5}},
        }
        assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
        [seen] = recorder.bodies
        assert "priority" not in seen and "nvext" not in seen


def test_the_plugin_is_the_one_vllm_attached() -> None:
    assert KvMeshEndpointPlugin.name == "kvmesh"


async def test_a_peers_streamed_answer_is_relayed_from_the_socket_callback_inside_vllm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM adds ``--middleware`` classes after its own (CORS and the rest), so kvmesh's sits right
    inside Starlette's outermost layer, whose ``send`` wrapper the direct relay looks through."""
    peer = StreamingEngine(events=24)
    monkeypatch.setenv("KVMESH_ROUTER_KV_EVENTS", "false")  # the peer is a raw server: no events
    direct = get_metrics().relayed_chunks["direct"]
    async with (
        serve(peer) as engine,
        vllm_app(tmp_path, monkeypatch, policy="priority", peers=(engine.url,)) as (url, recorder, _, _),
        httpx.AsyncClient(base_url=url, timeout=10) as http,
    ):

        async def peer_up() -> bool:
            rows = (await http.get("/kvmesh/workers", headers=_auth())).json()["workers"]
            return any(row["url"] == engine.url and row["state"] == "up" for row in rows)

        for _ in range(250):
            if await peer_up():
                break
            await asyncio.sleep(0.02)
        before = direct._value.get()
        received = await pinned_stream_bytes(http, engine.url, "tiny-model")
        await wait_until(lambda: direct._value.get() > before)
        relayed = direct._value.get() - before
    assert received == peer.sent
    assert recorder.bodies == []  # vLLM's own handler never saw it
    assert relayed >= 12
