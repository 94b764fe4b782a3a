"""One log line per request the router took, as its answer ends (``--log-requests``,
``KVMESH_LOG_REQUESTS``): an operator's record of where each request went and how it went.

The router logged nothing per request: ``GET /kvmesh/decisions`` keeps the last 64 decisions and
``/metrics`` the totals, so "why did this request go there, and why was it slow" had no answer
once it was a minute old. vLLM logs each request with ``--enable-log-requests``, uvicorn's access
log is on by default under ``vllm serve``, and sglang-router logs every request it proxies; the
router runs with uvicorn's access log off (its formatting costs every request) and its own line
says more than an access log can:

    POST /v1/chat/completions 200 forwarded worker=http://10.0.0.2:8000 prompt_tokens=4113
    cached_predicted=4096 cached_reported=4096 ttft_ms=41.3 output_tokens=128 total_ms=812.4
    request_id=router-gpu-node-1-4021-0-5f3e9c01-17

``route`` is how it was served (``forwarded``, ``local``: by the engine the router runs in,
``rejected``: the router's own error, ``disconnected``: the client left first); a rejection names
the field and the reason, as its 4xx body does. ``cached_reported`` is the engine's
``cached_tokens``, when its answer carries usage; ``ttft_ms`` is a stream's first token, from the
request's arrival; ``queued_ms`` the time it waited in the router's queue, when it did. Nothing of
the prompt or the answer is logged. Off by default.

Lines go to the ``kvmesh.requests`` logger at INFO, set to INFO when the setting is on. Where the
process logs through its root logger (SGLang configures it) they go with the engine's own lines;
where nothing would write them (``vllm serve`` gives only vLLM's loggers a handler, and a line
below WARNING went nowhere) the logger gets a handler of its own on stderr (:func:`_make_visible`).
"""

from __future__ import annotations

import logging
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvmesh.router.asgi.accounting import RoutedAccount

logger = logging.getLogger("kvmesh.requests")


_ready = False


def _make_visible() -> None:
    """INFO, and a handler on stderr where none above would write the lines: looked at on the first
    line, once the host process has configured its logging (an engine may do so after the app,
    and the middleware in it, were built)."""
    global _ready
    _ready = True
    logger.setLevel(logging.INFO)
    if not logger.hasHandlers():
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s kvmesh: %(message)s"))
        logger.addHandler(handler)


def log_request(
    method: str,
    path: str,
    route: str,
    status: int,
    t0: float,
    account: RoutedAccount | None,
    refusal: tuple[str, str | None] | None = None,
) -> None:
    """Log one request: ``status`` 0 when the router never saw the answer's head (its own engine
    answered it untracked); ``t0`` its arrival (``time.perf_counter``); ``refusal`` the message and
    field of the router's own error."""
    if not _ready:
        _make_visible()
    parts = [method, path, str(status) if status else "-", route]
    if account is not None and account.decision is not None:
        decision = account.decision
        worker, rank = decision.worker
        parts.append(f"worker={worker}")
        if rank:
            parts.append(f"dp_rank={rank}")
        isl = account.parsed.isl
        if isl:
            parts.append(f"prompt_tokens={isl}")
        parts.append(f"cached_predicted={decision.cached_tokens}")
        if account.reported_cached is not None:
            parts.append(f"cached_reported={account.reported_cached}")
        if decision.waited > 0:
            parts.append(f"queued_ms={decision.waited * 1000:.1f}")
        if account.parsed.stream and account.t_first:
            parts.append(f"ttft_ms={(account.t_first - t0) * 1000:.1f}")
        parts.append(f"output_tokens={account.generated}")
    parts.append(f"total_ms={(time.perf_counter() - t0) * 1000:.1f}")
    if account is not None:
        parts.append(f"request_id={account.request_id}")
    if refusal is not None:
        message, field = refusal
        if field:
            parts.append(f"field={field}")
        parts.append(f"reason={message!r}")
    logger.info(" ".join(parts))
