"""The served model's tokenizer and chat template, exactly as SGLang's OpenAI server renders them.

A router that hashes other token ids than the engine caches never finds a prefix hit. Embedded in
SGLang's server, kvmesh tokenizes through SGLang's own objects, created by its app lifespan:

* chat: ``app.state.openai_serving_tokenize._tokenize_chat_request`` (what ``/v1/tokenize`` runs),
  which goes through ``OpenAIServingChat._process_messages``, the function chat serving itself
  uses: the same template (``--chat-template`` or the model's), tools and template kwargs;
* completions: ``tokenizer_manager.tokenizer.encode(text)``, as the TokenizerManager encodes a
  text prompt (special tokens added).

Bound on the first request from the ASGI ``scope["app"]`` (the lifespan has run by then); the
middleware's predicted-vs-reported cached-token metric shows whether the ids agree in practice.
"""

from __future__ import annotations

from typing import Any

from kvmesh.errors import ConfigError


class SglangTokenizer:
    """kvmesh's Tokenizer protocol over SGLang's tokenize serving and TokenizerManager."""

    name = "sglang"

    def __init__(self) -> None:
        self._serving: Any = None
        self._tokenizer: Any = None

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

    def decode(self, ids: list[int]) -> str:
        self._bound()
        return str(self._tokenizer.decode(list(ids)))
