"""The simulated engine: an OpenAI-compatible server over a paged KV cache with prefix caching.
It serves SGLang's native ``/generate`` as well (:mod:`kvmesh.mock.native_generate`), and
Anthropic's Messages API, ``/v1/messages``, as vLLM serves it (:mod:`kvmesh.mock.messages`).

    kvmesh mock --port 8001 --kv-events-endpoint tcp://127.0.0.1:5557     # from the shell

    from kvmesh.mock import run_mock                                     # from async code
    async with run_mock(speedup=10) as mock: ...

Layers, bottom up: ``block_pool`` (blocks, ref counts, LRU free list, KV events as a side
output), ``scheduler`` (vLLM-style continuous batching, pure), ``engine`` (the asyncio step loop
and the event publisher), ``server`` (the HTTP surface), ``testing`` (``run_mock``). Pins,
sessions and the ``/kvmesh/*`` routes are the engine-agnostic ones of :mod:`kvmesh.worker`.
"""

from kvmesh.mock.config import MockConfig
from kvmesh.mock.engine import GenerationParams, MockEngine, TokenStream
from kvmesh.mock.server import build_app
from kvmesh.mock.testing import RunningMock, run_mock

__all__ = [
    "GenerationParams",
    "MockConfig",
    "MockEngine",
    "RunningMock",
    "TokenStream",
    "build_app",
    "run_mock",
]
