"""kvmesh inside SGLang's server (SGLang 0.5.23): ``pip install 'kvmesh[sglang]'``.

* ``sglang.srt.plugins`` entry point -> :func:`kvmesh.adapters.sglang.plugin.register` (every
  SGLang process): the ``kvmesh`` KV-event publisher and the scheduler hooks that serve pins;
* ``python -m kvmesh.adapters.sglang <sglang launch_server arguments>`` (:mod:`.launcher`): SGLang's
  server with kvmesh's ``/kvmesh/*`` routes, its ``kv_state`` follower and, with a mesh
  configured, kvmesh's router middleware mounted on SGLang's own FastAPI app.

Nothing here imports SGLang at module import time. See docs/sglang.md.
"""

from __future__ import annotations

from kvmesh.adapters.sglang._sglang import SUPPORTED_SGLANG

__all__ = ["SUPPORTED_SGLANG"]
