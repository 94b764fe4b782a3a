"""The served model's own tokenizer and chat template, as a kvmesh :class:`~kvmesh.router.tokenizer.Tokenizer`.

A router that hashes different token ids than the engine caches never finds a prefix hit. When
the middleware is embedded in ``vllm serve``, it tokenizes with vLLM's own renderer: the same
tokenizer, the same chat template (``--chat-template`` or the model's), the same content format
and default template kwargs (``--default-chat-template-kwargs``), and vLLM's own split between
"render the conversation" and "tokenize the prompt" (special tokens added for completions, not
again after a chat template). The middleware's predicted-vs-reported cached-token metric shows
whether the two agree in practice.

vLLM builds its renderer while it initialises the app state, after middleware classes are
named, so :class:`EngineTokenizer` is bound on the first request (from the ASGI ``scope["app"]``).
"""

from __future__ import annotations

from typing import Any

from kvmesh.errors import ConfigError


class VllmTokenizer:
    """kvmesh's Tokenizer protocol over vLLM's ``BaseRenderer`` and ``OnlineRenderer`` settings."""

    name = "vllm"

    def __init__(
        self,
        renderer: Any,
        *,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        default_chat_template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.renderer = renderer
        self.chat_template = chat_template
        self.chat_template_content_format = chat_template_content_format
        self.default_chat_template_kwargs = dict(default_chat_template_kwargs or {})

    @classmethod
    def from_app_state(cls, state: Any) -> VllmTokenizer:
        online = state.online_renderer
        return cls(
            state.engine_client.renderer,
            chat_template=online.chat_template,
            chat_template_content_format=online.chat_template_content_format,
            default_chat_template_kwargs=online.default_chat_template_kwargs,
        )

    def encode(self, text: str) -> list[int]:
        prompt = self.renderer.tokenize_prompt({"prompt": text}, self.renderer.default_cmpl_tok_params)
        return list(prompt["prompt_token_ids"])

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        from vllm.renderers.params import ChatParams

        kwargs = {**self.default_chat_template_kwargs, "add_generation_prompt": add_generation_prompt}
        if tools is not None:
            kwargs["tools"] = tools
        params = ChatParams(
            chat_template=self.chat_template,
            chat_template_content_format=self.chat_template_content_format,  # type: ignore[arg-type]
            chat_template_kwargs=kwargs,
        )
        _, prompt = self.renderer.render_messages(messages, params)
        if "prompt_token_ids" not in prompt:
            prompt = self.renderer.tokenize_prompt(prompt, self.renderer.default_chat_tok_params)
        return list(prompt["prompt_token_ids"])

    def decode(self, ids: list[int]) -> str:
        return str(self.renderer.get_tokenizer().decode(list(ids)))


class EngineTokenizer:
    """A Tokenizer that forwards to the :class:`VllmTokenizer` bound once vLLM's app state exists."""

    name = "vllm"

    def __init__(self) -> None:
        self.bound: VllmTokenizer | None = None

    def bind_from_app(self, app: Any) -> None:
        state = getattr(app, "state", None)
        if state is not None and hasattr(state, "online_renderer") and hasattr(state, "engine_client"):
            self.bound = VllmTokenizer.from_app_state(state)

    def _target(self) -> VllmTokenizer:
        if self.bound is None:
            raise ConfigError("vLLM's tokenizer is not available yet (the app state has no renderer)")
        return self.bound

    def encode(self, text: str) -> list[int]:
        return self._target().encode(text)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        return self._target().apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt
        )

    def decode(self, ids: list[int]) -> str:
        return self._target().decode(ids)
