"""A fake ``tensorrt_llm`` for kvmesh's core tests: only what kvmesh.adapters.trtllm touches.

TensorRT-LLM cannot be installed on the machines these tests run on. Each module here names the
file of TensorRT-LLM's published source it stands in for and the version shape it follows; the
behaviour is written from those sources (signatures, event dict shapes, queue semantics), not
copied. Nothing here runs a model: "generation" is a paged prefix cache that emits KV events the
way TensorRT-LLM's ``KVCacheEventSerializer`` shapes them.
"""

__version__ = "0.0.0+kvmesh-fake"

from tensorrt_llm.llmapi import LLM, SamplingParams

__all__ = ["LLM", "SamplingParams"]
