"""vLLM 0.33's own SageMaker route (``POST /invocations``) behind kvmesh's middleware, on an app wired
by vLLM's code (``tests.engines.test_vllm_app.vllm_app``): vLLM's SageMaker router attached and the
app bootstrapped by ``model-hosting-container-standards``, as ``vllm serve`` does both.

Behind vLLM's chat route, the chat serving is a stand-in (vLLM's needs a model): it records the
request vLLM's handler built, after vLLM's SageMaker decorators had their say, and answers as
vLLM does. The fleet is this vLLM server, which serves the LoRA adapter ``sql-lora``, and a peer
that serves the base model alone."""

from __future__ import annotations

import asyncio
import warnings
from pathlib import Path
from typing import Any

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # torch's, at import
    import httpx
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionResponse,
        ChatCompletionResponseChoice,
        ChatMessage,
    )
    from vllm.entrypoints.serve.engine.protocol import UsageInfo

    from tests.engines.test_vllm_app import _auth, vllm_app
    from tests.engines.vllm_helpers import BLOCK_SIZE
    from tests.router.servers import StreamingEngine, serve

pytestmark = pytest.mark.engine_vllm

ADAPTER = "sql-lora"
HEADER = "X-Amzn-SageMaker-Adapter-Identifier"


class ChatServing:
    """Stands in for vLLM's ``OpenAIServingChat``: the model of every request vLLM's chat route
    handed it, answered as vLLM answers a whole chat request."""

    def __init__(self) -> None:
        self.models: list[str | None] = []

    async def create_chat_completion(self, request: Any, raw_request: Any) -> ChatCompletionResponse:
        self.models.append(request.model)
        choice = ChatCompletionResponseChoice(
            index=0, message=ChatMessage(role="assistant", content="ok"), finish_reason="stop"
        )
        usage = UsageInfo(prompt_tokens=10, completion_tokens=1, total_tokens=11)
        # (no model: vLLM's serving answers with the served model's name)
        return ChatCompletionResponse(model=request.model or "tiny-model", choices=[choice], usage=usage)


async def test_vllms_invocations_serves_the_adapter_its_header_names_and_the_router_hashes_it_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM writes the adapter named in SageMaker's header into the request's model; the router
    reads it the same way. The invocation goes to the one worker serving the adapter, and the
    blocks the router counts there are the adapter's: a chat request of the same messages that
    names the adapter is predicted to find them cached (without the header read, the invocation
    was hashed as the base model's, and that prediction was 0)."""
    serving = ChatServing()
    peer = StreamingEngine(events=2)
    monkeypatch.setenv("KVMESH_ROUTER_KV_EVENTS", "false")  # the router learns from its decisions
    async with (
        serve(peer) as engine,
        vllm_app(tmp_path, monkeypatch, policy="priority", peers=(engine.url,), chat_serving=serving) as (
            url,
            recorder,
            _,
            _,
        ),
        httpx.AsyncClient(base_url=url, timeout=10) as http,
    ):
        rows: dict[str, Any] = {}
        for _ in range(250):
            listed = (await http.get("/kvmesh/workers", headers=_auth())).json()["workers"]
            rows = {row["url"]: row for row in listed}
            if all(row["state"] == "up" for row in rows.values()) and rows[url]["lora_adapters"]:
                break
            await asyncio.sleep(0.02)
        assert (rows[url]["lora_adapters"], rows[engine.url]["lora_adapters"]) == ([ADAPTER], [])
        messages = [{"role": "user", "content": " ".join(f"w{i}" for i in range(80))}]
        body = {"model": "tiny-model", "messages": messages, "max_tokens": 1}

        answer = await http.post("/invocations", json=body, headers={HEADER: ADAPTER})
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == ADAPTER
        assert answer.headers["x-kvmesh-worker-id"] == url
        assert serving.models == [ADAPTER]  # (vLLM's own decorator wrote it into the model)

        timing = {"extra_fields": ["worker_id", "timing"]}
        chat = {"model": ADAPTER, "messages": messages, "max_tokens": 1, "nvext": timing}
        again = await http.post("/v1/chat/completions", json=chat)
        assert again.status_code == 200, again.text
        echo = again.json()["nvext"]
        assert echo["worker_id"]["decode_worker_id"] == url
        assert echo["timing"]["cached_tokens_predicted"] >= 4 * BLOCK_SIZE
        assert [b["model"] for b in recorder.bodies] == [ADAPTER]

        # Without the header, vLLM's SageMaker handling writes null into the model, whatever the
        # body named, and the base model serves it; so the router reads it: a request naming the
        # adapter in its body alone is predicted none of the adapter's blocks (sent to this
        # engine: the peer has no /invocations).
        pinned = {**body, "model": ADAPTER, "nvext": {"backend_instance_id": url, **timing}}
        plain = await http.post("/invocations", json=pinned)
        assert plain.status_code == 200, plain.text
        assert serving.models == [ADAPTER, None]
        assert plain.json()["nvext"]["timing"]["cached_tokens_predicted"] == 0
