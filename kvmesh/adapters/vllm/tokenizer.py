"""The served model's own tokenizer and chat template, as a kvmesh :class:`~kvmesh.router.request.tokenizer.Tokenizer`.

A router that hashes different token ids than the engine caches never finds a prefix hit. When
the middleware is embedded in ``vllm serve``, it tokenizes with vLLM's own renderer: the same
tokenizer, the same chat template (``--chat-template`` or the model's), the same content format
and default template kwargs (``--default-chat-template-kwargs``), and vLLM's own split between
"render the conversation" and "tokenize the prompt" (special tokens added for completions, not
again after a chat template). The middleware's predicted-vs-reported cached-token metric shows
whether the two agree in practice.

An Anthropic Messages body (``/v1/messages``) is converted into the chat request vLLM serves it as
by vLLM's own ``AnthropicServingMessages.to_chat_completion_request`` (:meth:`messages_as_chat`),
with what the serving worked out from the chat template at start-up: whether inline system
messages are merged into the first one. Its tools go to the template as vLLM's chat path hands
them (``model_dump`` of each).

vLLM builds its renderer while it initialises the app state, after middleware classes are
named, so :class:`VllmTokenizer` is bound on the first request (from the ASGI ``scope["app"]``).
"""

from __future__ import annotations

from typing import Any

from kvmesh.errors import ConfigError
from kvmesh.router.request.messages_api import template_arguments


class VllmTokenizer:
    """kvmesh's Tokenizer protocol over vLLM's ``BaseRenderer`` and ``OnlineRenderer`` settings,
    bound to them by :meth:`bind_from_app` once vLLM's app state exists."""

    name = "vllm"

    def __init__(self) -> None:
        self._renderer: Any = None
        self._chat_template: str | None = None
        self._chat_template_content_format = "auto"
        self._default_chat_template_kwargs: dict[str, Any] = {}
        self._messages: Any = None

    @property
    def bound(self) -> bool:
        return self._renderer is not None

    def bind_from_app(self, app: Any) -> None:
        """Take vLLM's renderer and chat settings from ``app.state``; a no-op until it has them."""
        state = getattr(app, "state", None)
        if state is None or not hasattr(state, "online_renderer") or not hasattr(state, "engine_client"):
            return
        online = state.online_renderer
        self._chat_template = online.chat_template
        self._chat_template_content_format = online.chat_template_content_format
        self._default_chat_template_kwargs = dict(online.default_chat_template_kwargs or {})
        self._messages = getattr(state, "anthropic_serving_messages", None)
        self._renderer = state.engine_client.renderer  # last: `bound` means every setting is in

    def _bound_renderer(self) -> Any:
        if self._renderer is None:
            raise ConfigError("vLLM's tokenizer is not available yet (the app state has no renderer)")
        return self._renderer

    def encode(self, text: str) -> list[int]:
        renderer = self._bound_renderer()
        prompt = renderer.tokenize_prompt({"prompt": text}, renderer.default_cmpl_tok_params)
        return list(prompt["prompt_token_ids"])

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[int]:
        renderer = self._bound_renderer()
        from vllm.renderers.params import ChatParams

        # (vLLM's chat request hands both to the template's arguments, as here)
        kwargs = {
            **self._default_chat_template_kwargs,
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
        }
        if tools is not None:
            kwargs["tools"] = tools
        params = ChatParams(
            chat_template=self._chat_template,
            chat_template_content_format=self._chat_template_content_format,  # type: ignore[arg-type]
            chat_template_kwargs=kwargs,
        )
        _, prompt = renderer.render_messages(messages, params)
        if "prompt_token_ids" not in prompt:
            prompt = renderer.tokenize_prompt(prompt, renderer.default_chat_tok_params)
        return list(prompt["prompt_token_ids"])

    def messages_as_chat(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """The chat body vLLM serves an Anthropic Messages body as (see the module docstring), or
        None where this server serves no Messages API (a model without generation)."""
        self._bound_renderer()
        serving = self._messages
        if serving is None:
            return None
        from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest

        request = AnthropicMessagesRequest(**{k: v for k, v in body.items() if k != "nvext"})
        # (thinking turned off is rendered with an effort vLLM works out per model; the router
        # needs only a constant one: such prompts are keyed apart by their template arguments)
        chat = type(serving).to_chat_completion_request(
            request, merge_inline_system=serving._merge_inline_system, disabled_thinking_effort="none"
        )
        view: dict[str, Any] = {
            "messages": list(chat.messages),
            "add_generation_prompt": chat.add_generation_prompt,
            "continue_final_message": chat.continue_final_message,
        }
        if chat.tools is not None:
            view["tools"] = [tool.model_dump() for tool in chat.tools]
        kwargs = template_arguments(chat.chat_template_kwargs, chat.reasoning_effort)
        if kwargs:
            view["chat_template_kwargs"] = kwargs
        for key in ("model", "cache_salt"):
            if body.get(key) is not None:
                view[key] = body[key]
        return view

    def decode(self, ids: list[int]) -> str:
        return str(self._bound_renderer().get_tokenizer().decode(list(ids)))
