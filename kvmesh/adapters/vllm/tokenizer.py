"""The served model's own tokenizer and chat template, as a kvmesh :class:`~kvmesh.router.request.tokenizer.Tokenizer`.

A router that hashes different token ids than the engine caches never finds a prefix hit. When
the middleware is embedded in ``vllm serve``, it tokenizes with vLLM's own renderer: the same
tokenizer, the same chat template (``--chat-template`` or the model's), the same content format
and default template kwargs (``--default-chat-template-kwargs``), and vLLM's own split between
"render the conversation" and "tokenize the prompt" (special tokens added for completions, not
again after a chat template). The middleware's predicted-vs-reported cached-token metric shows
whether the two agree in practice.

vLLM builds its renderer while it initialises the app state, after middleware classes are
named, so :class:`VllmTokenizer` is bound on the first request (from the ASGI ``scope["app"]``).
"""

from __future__ import annotations

from typing import Any

from kvmesh.errors import ConfigError


class VllmTokenizer:
    """kvmesh's Tokenizer protocol over vLLM's ``BaseRenderer`` and ``OnlineRenderer`` settings,
    bound to them by :meth:`bind_from_app` once vLLM's app state exists."""

    name = "vllm"

    def __init__(self) -> None:
        self._renderer: Any = None
        self._chat_template: str | None = None
        self._chat_template_content_format = "auto"
        self._default_chat_template_kwargs: dict[str, Any] = {}

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

    def decode(self, ids: list[int]) -> str:
        return str(self._bound_renderer().get_tokenizer().decode(list(ids)))
