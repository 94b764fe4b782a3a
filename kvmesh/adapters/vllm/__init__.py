"""kvmesh inside ``vllm serve`` (vLLM 0.33.0): ``pip install 'kvmesh[vllm]'``.

Three entry points, each imported by vLLM itself; none imports vLLM at module import time:

* ``vllm.general_plugins`` -> :func:`kvmesh.adapters.vllm.plugin.register` (every vLLM process):
  the ``kvmesh`` KV-event publisher and the engine-core RPC method;
* ``vllm.endpoint_plugins`` -> :func:`kvmesh.adapters.vllm.endpoints.endpoint_plugin` (API server,
  with ``VLLM_PLUGINS=kvmesh``): ``/kvmesh/info``, ``kv_state``, ``pin_prefix``, ``session_control``;
* ``--middleware kvmesh.adapters.vllm.KvMeshMiddleware``: kvmesh's router embedded in the server.

See docs/vllm.md for the command lines.
"""

from __future__ import annotations

from kvmesh.adapters.vllm._vllm import SUPPORTED_VLLM
from kvmesh.adapters.vllm.middleware import KvMeshMiddleware

__all__ = ["SUPPORTED_VLLM", "KvMeshMiddleware"]
