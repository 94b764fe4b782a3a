"""SGLang 0.5.23's real HTTP app with kvmesh mounted by the launcher, served on loopback (a child
process of tests/engines/test_sglang_middleware.py: SGLang's app and its mount are process globals).

``python -m tests.engines.sglang_middleware_server PORT [sglang launch_server args...]``; the mesh
settings (``KVMESH_WORKERS`` ...) come from the environment, as the launcher would leave them. With
``--api-key``, SGLang's own API-key middleware is added as its launch adds it.

Real: SGLang's FastAPI ``app`` and routes (its ``/v1/chat/completions`` route parses the body into
SGLang's own ``ChatCompletionRequest``), ``prepare_server_args`` through kvmesh's launcher (which
mounts kvmesh's routes and middleware), and SGLang's chat tokenization path
(``OpenAIServingTokenize._tokenize_chat_request`` -> ``OpenAIServingChat._process_messages`` with a
real ``TemplateManager``) over a real Hugging Face fast tokenizer built in memory (this machine
cannot download a model's). Stand-ins (TEST-ONLY): the TokenizerManager (only the attributes the
serving classes read) and the chat serving's ``handle_request``, which answers with what SGLang's
route handed it: the raw body and the parsed request's ``priority``. The Responses serving is
SGLang's real ``OpenAIServingResponses`` (its input items turned into chat messages, rendered by
its ``_make_request``) with a stand-in ``create_responses`` that answers with the prompt's ids
instead of generating. ``/generate`` is SGLang's real route and request parsing, over a stand-in
``generate_request`` that tokenizes with the real TokenizerManager's own text tokenization and
answers with those ids (and the priority and sampling parameters SGLang parsed) instead of
generating. The Anthropic Messages serving is SGLang's real ``AnthropicServing`` over its real chat
serving (its conversion, validation and chat tokenization), with a stand-in
``_handle_non_streaming_request`` that answers with the prompt's ids instead of generating. The
Ollama serving (``/api/chat``, ``/api/generate``) is SGLang's real ``OllamaServing`` (its own
rendering of the body) over the stand-in ``generate_request``, so its answer counts the prompt it
rendered (``prompt_eval_count``). ``/test/sglang-vertex`` calls SGLang's real Vertex AI handler
(kvmesh's middleware takes its own path, ``/vertex_generate``), over the same stand-in.
"""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace
from typing import Any

from tests.engines import sglang_env

WORDS = ["<s>", "<unk>", "user", "assistant", ":"] + [f"w{i}" for i in range(400)]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)


def hf_tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


class TokenizerManager:
    """The attributes SGLang's OpenAI serving classes read from the real TokenizerManager."""

    served_model_name = "dummy"
    server_args = None
    gracefully_exit = False  # read by SGLang's /health

    def __init__(self) -> None:
        from sglang.srt.managers.tokenizer_manager import ServerStatus

        self.server_status = ServerStatus.Up
        self.tokenizer = hf_tokenizer()
        self.model_config = SimpleNamespace(
            is_multimodal=False,
            is_embedding_gemma=False,
            context_len=4096,
            get_default_sampling_params=lambda: {},
            hf_config=SimpleNamespace(model_type="llama", architectures=["LlamaForCausalLM"]),
        )

    def config_value(self, name: str) -> Any:
        return None

    # SGLang's own text tokenization for /generate (the real TokenizerManager's methods,
    # REAL_TOKENIZATION; they read only the tokenizer, the model config and the async batch
    # tokenizer, which is off here).
    async_dynamic_batch_tokenizer = None

    async def generate_request(self, obj: Any, request: Any = None) -> Any:
        """TEST-ONLY ``/generate``: the ids SGLang's tokenization gives the request, no generation."""
        obj.normalize_batch_and_arguments()
        if obj.text is not None:
            ids, _ = await self._tokenize_texts(obj.text)
        else:
            ids = list(obj.input_ids)
        meta = {"id": obj.rid, "prompt_tokens": len(ids), "completion_tokens": 1, "cached_tokens": 0}
        seen = {"ids": ids, "priority": obj.priority, "sampling_params": obj.sampling_params}
        yield {"text": "w1", "output_ids": [6], "meta_info": meta, "seen": seen}

    def create_abort_task(self, obj: Any) -> Any:
        return None

    aborted: list[tuple[str, bool]] = []

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """TEST-ONLY: what SGLang's ``/abort_request`` route asked to abort, kept for ``/test/aborts``."""
        self.aborted.append((rid, abort_all))


# The real TokenizerManager's text tokenization, taken onto the stand-in once SGLang is importable.
REAL_TOKENIZATION = (
    "_tokenize_texts",
    "_detect_input_format",
    "_prepare_tokenizer_input",
    "_extract_tokenizer_results",
)


class EchoChat:
    """``app.state.openai_serving_chat``: answers with the body SGLang's route received."""

    async def handle_request(self, request: Any, raw_request: Any) -> Any:
        from fastapi.responses import JSONResponse

        body = (await raw_request.body()).decode()
        seen = {"body": json.loads(body), "priority": request.priority}
        return JSONResponse(
            {
                "id": "chatcmpl-echo",
                "object": "chat.completion",
                "created": 0,
                "model": "dummy",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": json.dumps(seen)},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )


def echo_responses(tm: Any, templates: Any) -> Any:
    """SGLang's real Responses serving, answering with the token ids its own rendering gave."""
    from sglang.srt.entrypoints.openai.serving_responses import OpenAIServingResponses

    class EchoResponses(OpenAIServingResponses):  # type: ignore[misc]
        async def create_responses(self, request: Any, raw_request: Any = None) -> Any:
            from fastapi.responses import JSONResponse

            *_, processed = await self._make_request(request, None, tm.tokenizer)
            ids = list(processed.prompt_ids)
            usage = {
                "input_tokens": len(ids),
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": 1,
            }
            answer = {
                "id": "resp_echo",
                "object": "response",
                "status": "completed",
                "output": [],
                "usage": usage,
            }
            return JSONResponse({**answer, "seen": {"ids": ids}})

    return EchoResponses(tm, templates, enable_prompt_tokens_details=True, tool_server=None)


def echo_messages(tm: Any, templates: Any) -> Any:
    """SGLang's real Anthropic Messages serving over its real chat serving, answering with the ids
    SGLang's own conversion and chat tokenization gave the request instead of generating."""
    from sglang.srt.entrypoints.anthropic.serving import AnthropicServing
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionResponse
    from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat

    class EchoIdsChat(OpenAIServingChat):  # type: ignore[misc]
        async def _handle_non_streaming_request(self, adapted: Any, processed: Any, raw: Any) -> Any:
            ids = list(adapted.input_ids)
            return ChatCompletionResponse.model_validate(
                {
                    "id": "msg_echo",
                    "model": "dummy",
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": json.dumps({"ids": ids})},
                            "finish_reason": "stop",
                        }
                    ],
                    "usage": {
                        "prompt_tokens": len(ids),
                        "completion_tokens": 1,
                        "total_tokens": len(ids) + 1,
                    },
                }
            )

    return AnthropicServing(EchoIdsChat(tm, templates))


async def relayed_chunks(request: Any) -> Any:
    """TEST-ONLY: kvmesh's ``kvmesh_relayed_chunks_total`` by path, read in this process."""
    from starlette.responses import JSONResponse

    from kvmesh.router.mesh.metrics import get_metrics

    return JSONResponse({path: c._value.get() for path, c in get_metrics().relayed_chunks.items()})


async def speculative_prefills(request: Any) -> Any:
    """TEST-ONLY: kvmesh's ``kvmesh_speculative_prefills_total`` by outcome, read in this process."""
    from starlette.responses import JSONResponse

    from kvmesh.router.mesh.metrics import get_metrics

    counter = get_metrics().speculative_prefills
    return JSONResponse({o: counter.labels(o)._value.get() for o in ("done", "failed", "cancelled")})


async def aborts(request: Any) -> Any:
    """TEST-ONLY: the aborts SGLang's ``/abort_request`` route handed the TokenizerManager."""
    from starlette.responses import JSONResponse

    return JSONResponse(TokenizerManager.aborted)


async def sglang_vertex(request: Any) -> Any:
    """TEST-ONLY: SGLang's own Vertex AI route (its real handler), called past kvmesh's
    middleware, which takes the route's own path: what SGLang alone answers a body."""
    from sglang.srt.entrypoints import http_server
    from sglang.srt.managers.io_struct import VertexGenerateReqInput

    body = await request.json()
    vertex = VertexGenerateReqInput(instances=body["instances"], parameters=body.get("parameters"))
    return await http_server.vertex_generate(vertex, request)


def main() -> None:
    port, sglang_args = int(sys.argv[1]), sys.argv[2:]
    sglang_env.prepare()
    import uvicorn
    from starlette.routing import Route

    from kvmesh.adapters.sglang import launcher

    server_args = launcher.prepare(["--model-path", "dummy", *sglang_args], environ=os.environ)  # type: ignore[arg-type]
    from sglang.srt import runtime_context
    from sglang.srt.entrypoints import http_server
    from sglang.srt.entrypoints.ollama.serving import OllamaServing
    from sglang.srt.entrypoints.openai.serving_tokenize import OpenAIServingTokenize
    from sglang.srt.managers.tokenizer_manager import TokenizerManager as Real
    from sglang.srt.parser.template_manager import TemplateManager

    runtime_context.publish(server_args, role="tokenizer_manager")
    for name in REAL_TOKENIZATION:
        setattr(TokenizerManager, name, getattr(Real, name))
    tm = TokenizerManager()
    templates = TemplateManager()
    http_server.set_global_state(
        http_server._GlobalState(
            tokenizer_manager=tm, template_manager=templates, scheduler_info={"max_total_num_tokens": 4096}
        )
    )
    app = http_server.app
    app.state.openai_serving_tokenize = OpenAIServingTokenize(tm, templates)
    app.state.openai_serving_chat = EchoChat()
    app.state.openai_serving_responses = echo_responses(tm, templates)
    app.state.anthropic_serving = echo_messages(tm, templates)
    app.state.ollama_serving = OllamaServing(tm)
    app.router.routes.append(Route("/test/relayed-chunks", relayed_chunks))
    app.router.routes.append(Route("/test/speculative-prefills", speculative_prefills))
    app.router.routes.append(Route("/test/aborts", aborts))
    app.router.routes.append(Route("/test/sglang-vertex", sglang_vertex, methods=["POST"]))
    if server_args.api_key:  # as SGLang's launch does, after kvmesh's mount: outside kvmesh's layer
        from sglang.srt.utils.auth import add_api_key_middleware

        add_api_key_middleware(app, api_key=server_args.api_key, admin_api_key=server_args.admin_api_key)
    # SGLang's lifespan starts the real TokenizerManager's loops: not here (no scheduler, no model).
    # (SGLang hands its --fastapi-root-path to uvicorn, which puts it before every path)
    root_path = http_server.get_serving().fastapi_root_path or ""
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off", root_path=root_path)


if __name__ == "__main__":
    main()
