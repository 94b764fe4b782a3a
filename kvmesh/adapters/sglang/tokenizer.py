"""The served model's tokenizer and chat template, exactly as SGLang's OpenAI server renders them.

A router that hashes other token ids than the engine caches never finds a prefix hit. Embedded in
SGLang's server, kvmesh tokenizes through SGLang's own objects, created by its app lifespan:

* chat: ``app.state.openai_serving_tokenize._tokenize_chat_request`` (what ``/v1/tokenize`` runs),
  which goes through ``OpenAIServingChat._process_messages``, the function chat serving itself
  uses: the same template (``--chat-template`` or the model's), tools and template kwargs;
* completions: ``tokenizer_manager.tokenizer.encode(text)``, as the TokenizerManager encodes a
  text prompt (special tokens added);
* the Responses API: ``app.state.openai_serving_responses`` turns the body into chat messages and
  tools its own way (``_construct_input_messages``: developer messages become labelled system text,
  system text is coalesced, content parts become chat parts, assistant items merge), which the
  chat path above then renders. Without that serving (SGLang without ``openai-harmony`` serves no
  ``/v1/responses``) the router reads the body as vLLM renders it.
* Anthropic's Messages API: ``app.state.anthropic_serving`` converts the body into the chat
  request SGLang serves it as (``_convert_to_chat_completion_request``), which the chat path above
  then renders; its tools are left out where its ``tool_choice`` is ``none``, as SGLang's chat
  path leaves them out.

Bound on the first request from the ASGI ``scope["app"]`` (the lifespan has run by then); the
middleware's predicted-vs-reported cached-token metric shows whether the ids agree in practice.
"""

from __future__ import annotations

from typing import Any

from kvmesh.errors import ConfigError
from kvmesh.router.request.messages_api import template_arguments

# Fields of a Responses body that do not change its prompt (or name what only another engine has).
_NOT_RENDERED = frozenset(("nvext", "previous_response_id", "background", "stream", "store"))


class SglangTokenizer:
    """kvmesh's Tokenizer protocol over SGLang's tokenize serving and TokenizerManager."""

    name = "sglang"

    def __init__(self) -> None:
        self._serving: Any = None
        self._tokenizer: Any = None
        self._responses: Any = None
        self._anthropic: Any = None

    @property
    def bound(self) -> bool:
        return self._serving is not None and self._tokenizer is not None

    def bind_from_app(self, app: Any) -> None:
        """Take SGLang's serving objects from ``app.state``; a no-op until the lifespan made them."""
        state = getattr(app, "state", None)
        serving = getattr(state, "openai_serving_tokenize", None) if state is not None else None
        if serving is None:
            return
        tokenizer = getattr(serving.tokenizer_manager, "tokenizer", None)
        if tokenizer is None:
            return  # --skip-tokenizer-init: nothing to tokenize with
        self._tokenizer = tokenizer
        self._serving = serving
        self._responses = getattr(state, "openai_serving_responses", None)
        self._anthropic = getattr(state, "anthropic_serving", None)

    def _bound(self) -> Any:
        if self._serving is None:
            raise ConfigError(
                "SGLang's tokenizer is not available yet (the app state has no tokenize serving)"
            )
        return self._serving

    def encode(self, text: str) -> list[int]:
        self._bound()
        return list(self._tokenizer.encode(text))

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[int]:
        serving = self._bound()
        from sglang.srt.entrypoints.openai.protocol import TokenizeRequest

        fields: dict[str, Any] = {"messages": messages}
        if tools is not None:
            fields["tools"] = tools
        if not add_generation_prompt:
            fields["add_generation_prompt"] = False
        if continue_final_message:  # (a field of SGLang's TokenizeRequest, rendered its own way)
            fields["continue_final_message"] = True
        return list(serving._tokenize_chat_request(TokenizeRequest(**fields)))

    def responses_as_chat(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """The chat body SGLang renders a Responses body as (see the module docstring), or None
        where this server has no Responses serving."""
        self._bound()
        serving = self._responses
        if serving is None:
            return None
        from sglang.srt.entrypoints.openai.protocol import ResponsesRequest

        # Only this request's own items: a stored conversation lives on the engine that stored it
        # (the request is sent there), and is never read from this one's store.
        fields = {k: v for k, v in body.items() if k not in _NOT_RENDERED}
        request = ResponsesRequest(**fields)
        messages = serving._construct_input_messages(request)
        tools = [tool.model_dump() for tool in serving._response_tools_to_chat_tools(request)]
        # (SGLang's Responses serving never continues a message: a generation prompt, always)
        view: dict[str, Any] = {
            "messages": messages,
            "add_generation_prompt": True,
            "continue_final_message": False,
        }
        if tools:
            view["tools"] = tools
        return view

    def messages_as_chat(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """The chat body SGLang serves an Anthropic Messages body as (see the module docstring),
        or None where this server has no Messages serving."""
        self._bound()
        serving = self._anthropic
        if serving is None:
            return None
        from sglang.srt.entrypoints.anthropic.protocol import AnthropicMessagesRequest

        request = AnthropicMessagesRequest(**{k: v for k, v in body.items() if k != "nvext"})
        chat = serving._convert_to_chat_completion_request(request)
        messages = [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in chat.messages]
        view: dict[str, Any] = {
            "messages": messages,
            "add_generation_prompt": True,
            "continue_final_message": False,
        }
        if chat.tools and chat.tool_choice != "none":
            view["tools"] = [tool.model_dump() for tool in chat.tools]
        kwargs = template_arguments(chat.chat_template_kwargs, chat.reasoning_effort)
        if kwargs:
            view["chat_template_kwargs"] = kwargs
        if body.get("model") is not None:
            view["model"] = body["model"]
        return view

    def decode(self, ids: list[int]) -> str:
        self._bound()
        return str(self._tokenizer.decode(list(ids)))
