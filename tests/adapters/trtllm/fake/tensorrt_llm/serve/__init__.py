"""Fake of ``tensorrt_llm/serve/__init__.py`` (re-exports OpenAIServer, as serve.py imports it)."""

from tensorrt_llm.serve.openai_server import OpenAIServer

__all__ = ["OpenAIServer"]
