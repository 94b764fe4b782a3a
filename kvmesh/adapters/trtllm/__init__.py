"""kvmesh inside ``trtllm-serve`` (TensorRT-LLM): ``python -m kvmesh.adapters.trtllm <serve args>``.

TensorRT-LLM has no plugin or middleware hook, so a launcher runs trtllm-serve's own entry point
after patching its OpenAIServer (:mod:`.server`). Inside the server:

* :mod:`.bridge` (with :mod:`.convert`, :mod:`.record`): the only reader of the engine's KV-event
  queue, publishing vLLM's ZMQ wire per attention-DP rank and re-serving ``POST /kv_cache_events``;
* :mod:`.backend`: ``/kvmesh/info``, ``kv_state``, ``pin_prefix`` and ``session_control``;
* :mod:`.retention`: pins and sessions as TensorRT-LLM cache-retention claims (best-effort);
* :mod:`.hints`: request priority (where the engine has one) and session turns;
* :mod:`.middleware`: kvmesh's router on trtllm-serve's app.

Written against TensorRT-LLM's published source and tested against fakes of it; it was not run
against real TensorRT-LLM. See docs/trtllm.md. Nothing here imports TensorRT-LLM at import time.
"""

from __future__ import annotations

from kvmesh.adapters.trtllm._trtllm import INSTALL_HINT, import_trtllm

__all__ = ["INSTALL_HINT", "import_trtllm"]
