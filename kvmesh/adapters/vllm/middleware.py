"""``--middleware kvmesh.adapters.vllm.KvMeshMiddleware``: kvmesh's router embedded in ``vllm serve``.

The engine-agnostic :class:`kvmesh.router.asgi.middleware.KvMeshMiddleware` with the vLLM glue that
vLLM's no-argument ``app.add_middleware(cls)`` cannot pass in:

* the tokenizer defaults to the served model's own (``KVMESH_TOKENIZER=engine``), bound to vLLM's
  renderer on the first request;
* vLLM's token-in-token-out API (``/inference/v1/generate``) is routed too, and an abort of its
  requests (``/inference/v1/abort_requests``) reaches the engine that runs them;
* nothing for sessions: the router's own forwarding (:func:`kvmesh.router.asgi.forwarding.session_header`)
  tags every turn of a kvmesh session with vLLM's native ``X-Session-ID`` header on every path
  (served here, forwarded to a peer, either stage of a disaggregated request), so vLLM carries the
  id into the engine core, where kvmesh's session retention sees each turn.

Priority polarity needs no glue here: the middleware rewrites ``nvext.agent_hints.priority`` per
the serving worker's ``/kvmesh/info`` ``priority_polarity`` (``lower_first`` for vLLM with
``--scheduling-policy priority``, so vLLM receives ``-priority``).
"""

from __future__ import annotations

import os
from typing import Any

from kvmesh.adapters.vllm.tokenizer import VllmTokenizer
from kvmesh.router.asgi.middleware import WITH_TOKENS
from kvmesh.router.asgi.middleware import KvMeshMiddleware as _CoreMiddleware
from kvmesh.router.mesh.settings import MeshSettings


class KvMeshMiddleware(_CoreMiddleware):
    """kvmesh's routing middleware for ``vllm serve --middleware`` (no constructor arguments)."""

    def __init__(self, app: Any, *, settings: MeshSettings | None = None) -> None:
        if settings is None:
            settings = MeshSettings.load()
            if "KVMESH_TOKENIZER" not in os.environ and "tokenizer" not in _config_file_keys():
                settings = settings.replace(tokenizer="engine")
        self.engine_tokenizer = VllmTokenizer()
        # (vLLM's token-in-token-out API too, which vLLM serves when started with
        # --enable-scale-out or --tokens-only: workers say so in /kvmesh/info)
        super().__init__(
            app, settings=settings, tokenizer=self.engine_tokenizer, generation_paths=WITH_TOKENS
        )

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and not self.engine_tokenizer.bound and "app" in scope:
            self.engine_tokenizer.bind_from_app(scope["app"])
        await super().__call__(scope, receive, send)


def _config_file_keys() -> set[str]:
    """Top-level keys of the KVMESH_CONFIG file, if any (a tokenizer named there wins too).
    MeshSettings.load() has already read and validated the file."""
    path = os.environ.get("KVMESH_CONFIG")
    if not path:
        return set()
    import tomllib  # KVMESH_CONFIG already requires Python 3.11+

    with open(path, "rb") as f:
        return set(tomllib.load(f))
