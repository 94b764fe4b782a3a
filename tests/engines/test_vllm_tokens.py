"""vLLM's token-in-token-out API (``/inference/v1/generate``) routed inside ``vllm serve`` (engine
tier).

The app is test_vllm_app's: vLLM's own CLI, plugin loader and middleware mount, a real KV cache
manager publishing its events to the router. Here vLLM's own routes for the token API are
registered as ``vllm serve`` registers them (so vLLM's request model validates every body that
reaches it, and its abort route calls the engine client); only the serving behind them, which
needs a model, is a stand-in that answers in vLLM's response classes.
"""

from __future__ import annotations

import asyncio
import json
import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # torch's, at import
    import httpx
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
        GenerateRequest,
        GenerateTokensChoice,
        GenerateTokensResponse,
        GenerateTokensStreamChoice,
        GenerateTokensStreamResponse,
    )
    from vllm.entrypoints.serve.engine.protocol import PromptTokenUsageInfo, UsageInfo

    from tests.engines.test_vllm_app import TOKEN, vllm_app
    from tests.engines.vllm_helpers import BLOCK_SIZE
    from tests.router.servers import serve

pytestmark = pytest.mark.engine_vllm

PROMPT = list(range(1000, 1000 + 5 * BLOCK_SIZE))
AUTH = {"authorization": f"Bearer {TOKEN}"}


class TokenServing:
    """Stands in for vLLM's ``ServingTokens``: keeps each request vLLM parsed, answers two tokens
    as vLLM does (the whole answer, or one event a token and the usage event when asked)."""

    def __init__(self) -> None:
        self.requests: list[GenerateRequest] = []

    async def serve_tokens(self, request: GenerateRequest, raw_request: Any) -> Any:
        self.requests.append(request)
        rid = f"generate-tokens-{request.request_id}"
        usage = UsageInfo(
            prompt_tokens=len(request.token_ids),
            completion_tokens=2,
            total_tokens=len(request.token_ids) + 2,
            prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=5 * BLOCK_SIZE),
        )
        if not request.stream:
            choice = GenerateTokensChoice(index=0, token_ids=[7, 8], finish_reason="length")
            return GenerateTokensResponse(request_id=rid, choices=[choice], usage=usage)

        async def events() -> AsyncIterator[str]:
            for token, finish in ((7, None), (8, "length")):
                choice = GenerateTokensStreamChoice(index=0, token_ids=[token], finish_reason=finish)
                yield f"data: {GenerateTokensStreamResponse(request_id=rid, choices=[choice]).model_dump_json()}\n\n"
            options = request.stream_options
            if options is not None and options.include_usage:
                last = GenerateTokensStreamResponse(request_id=rid, choices=[], usage=usage)
                yield f"data: {last.model_dump_json(exclude_none=True)}\n\n"
            yield "data: [DONE]\n\n"

        return events()


async def _indexed(http: httpx.AsyncClient, blocks: int) -> None:
    for _ in range(200):
        workers = (await http.get("/kvmesh/workers", headers=AUTH)).json()["workers"]
        if sum(w["indexed_blocks"] for w in workers) >= blocks:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"the router never indexed {blocks} blocks: {workers}")


async def test_without_scale_out_vllm_serves_no_token_api_and_the_router_says_how_to_start_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with (
        vllm_app(tmp_path, monkeypatch, policy="priority", tokens=TokenServing()) as (url, *_),
        httpx.AsyncClient(base_url=url, timeout=10) as http,
    ):
        assert (await http.get("/kvmesh/info", headers=AUTH)).json()["tokens_api"] is False
        reply = await http.post(
            "/inference/v1/generate", json={"token_ids": PROMPT, "sampling_params": {"max_tokens": 2}}
        )
        assert reply.status_code == 404, reply.text
        assert reply.json()["error"]["param"] == "path"
        assert "--enable-scale-out" in reply.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_token_request_is_credited_with_vllms_cached_pages_and_reaches_vllm_in_its_fields(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    serving = TokenServing()
    async with (
        vllm_app(tmp_path, monkeypatch, policy="priority", flags=("--enable-scale-out",), tokens=serving) as (
            url,
            _,
            _,
            runner,
        ),
        httpx.AsyncClient(base_url=url, timeout=10) as http,
    ):
        assert (await http.get("/kvmesh/info", headers=AUTH)).json()["tokens_api"] is True
        runner.run(PROMPT)  # vLLM's KV cache manager caches the prompt's 5 pages, and says so
        await _indexed(http, 5)
        body = {
            "request_id": "rollout-1",
            "token_ids": [*PROMPT, 1, 2, 3],
            "sampling_params": {"max_tokens": 2, "top_p": 0.5},
            "stream": stream,
            "stream_options": {"include_usage": True} if stream else None,
            "nvext": {"agent_hints": {"priority": 5}, "greed_sampling": True, "max_thinking_tokens": 32},
        }
        reply = await http.post("/inference/v1/generate", json=body)
        assert reply.status_code == 200, reply.text
        if stream:
            events = [e.removeprefix("data: ") for e in reply.text.split("\n\n") if e.startswith("data: ")]
            assert events[-1] == "[DONE]"
            assert [json.loads(e)["choices"][0]["token_ids"] for e in events[:2]] == [[7], [8]]
        else:
            assert reply.json()["choices"][0]["token_ids"] == [7, 8]
        [seen] = serving.requests  # (as vLLM's own request model read it)
        assert seen.token_ids == body["token_ids"] and seen.request_id == "rollout-1"
        assert seen.priority == -5  # vLLM runs lower values first
        params = seen.sampling_params
        assert params.temperature == 0.0  # greedy (vLLM then sets top_k and top_p aside itself)
        assert params.max_tokens == 2 and params.thinking_token_budget == 32
        decisions = (await http.get("/kvmesh/decisions?limit=1", headers=AUTH)).json()["decisions"]
        [chosen] = [c for c in decisions[0]["candidates"] if c["chosen"]]
        assert chosen["prefill_tokens"] == len(body["token_ids"]) - 5 * BLOCK_SIZE  # 5 pages credited


def _peer(aborted: list[dict[str, Any]], headers: list[dict[str, str]]) -> Starlette:
    """Another vLLM worker of the fleet, serving the token API: keeps the aborts it is sent."""

    async def info(request: Request) -> Response:
        facts = {"backend": "vllm", "model": "tiny-model", "block_size": BLOCK_SIZE, "tokens_api": True}
        # (it publishes no events here; a KV-mode router admits only a worker that says where)
        return JSONResponse({**facts, "kv_events_endpoints": ["tcp://127.0.0.1:9"]})

    async def ok(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "tiny-model", "object": "model"}]})

    async def abort(request: Request) -> Response:
        aborted.append(await request.json())
        headers.append(dict(request.headers))
        return Response(status_code=200)

    return Starlette(
        routes=[
            Route("/kvmesh/info", info),
            Route("/health", ok),
            Route("/v1/models", ok),
            Route("/inference/v1/abort_requests", abort, methods=["POST"]),
        ]
    )


async def test_an_abort_reaches_the_engine_and_every_peer_that_may_run_the_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The router may have sent the request to a peer: an abort that stopped only this engine's
    requests would leave it running there for nobody."""
    peer_aborts: list[dict[str, Any]] = []
    peer_headers: list[dict[str, str]] = []
    async with (
        serve(_peer(peer_aborts, peer_headers)) as peer,
        vllm_app(
            tmp_path,
            monkeypatch,
            policy="priority",
            peers=(peer.url,),
            flags=("--enable-scale-out",),
            tokens=TokenServing(),
        ) as (url, _, client, _),
        httpx.AsyncClient(base_url=url, timeout=10) as http,
    ):
        local: list[list[str]] = []

        async def abort(request_ids: Any, internal: bool = False) -> None:
            local.append(list(request_ids))

        client.abort = abort  # type: ignore[attr-defined]
        for _ in range(200):  # (the peer is admitted at its first health check)
            workers = (await http.get("/kvmesh/workers", headers=AUTH)).json()["workers"]
            if all(w["state"] == "up" and w["tokens_api"] for w in workers) and len(workers) == 2:
                break
            await asyncio.sleep(0.02)
        reply = await http.post("/inference/v1/abort_requests", json={"request_ids": ["generate-tokens-r1"]})
        assert reply.status_code == 200 and reply.content == b""
        for _ in range(100):  # (vLLM's route aborts in a task of its own)
            if local:
                break
            await asyncio.sleep(0.01)
        assert local == [["generate-tokens-r1"]]
        assert peer_aborts == [{"request_ids": ["generate-tokens-r1"]}]
        # marked as a peer's hop, so that the peer's own middleware asks no one in turn
        assert "x-kvmesh-hop" in peer_headers[0]
        bad = await http.post("/inference/v1/abort_requests", json={"ids": ["x"]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "request_ids"
        assert len(peer_aborts) == 1 and len(local) == 1


def test_vllms_renderers_are_relayed_by_the_standalone_router() -> None:
    """vLLM's scale-out renderers (a request rendered into the token-id request its
    /inference/v1/generate takes, and back) are each in kvmesh.router.asgi.any_worker's paths, and
    /v1/responses/render is not taken for a stored response."""
    from vllm.entrypoints.scale_out.derender.api_router import router as derender_router
    from vllm.entrypoints.scale_out.render.api_router import router as render_router

    from kvmesh.router.asgi import any_worker, stored_responses

    paths = {r.path for r in (*render_router.routes, *derender_router.routes) if "POST" in r.methods}
    assert "/v1/chat/completions/render" in paths and "/v1/completions/derender" in paths
    assert paths <= set(any_worker.PATHS)
    assert not any(stored_responses.handles(p) for p in paths)
