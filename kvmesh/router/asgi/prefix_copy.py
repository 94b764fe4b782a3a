"""Copies of a hot shared prefix made by the front itself, in the background.

The latency cost copies a prefix many requests share to one more worker once the waits the copy
saves the requests to come outweigh its cold prefill (:mod:`kvmesh.router.core.copies`). Made by
the request being routed, that cold prefill is the request's own time to first token: the copy's
worker answers it later than a holder would have, and each copy lands in the run's tail. Where a
holder is the request's fastest place, the router sends it there and names the copy in its
decision (``Decision.copy``); this module makes it: a one-token ``/v1/completions`` request whose
prompt is the prefix's token ids, to the worker the cost chose for the copy. The engine computes
and caches the prefix as it would have for the request, and no client waits for it.

It counts as load on that worker from the moment it is decided (``KvRouter.track``), so the next
decisions see the copy in flight there, and the blocks it carries, as they see a request's; with
replica sync, peer replicas count it too, as they count this replica's decisions. It is
the router's own work, bounded by one generated token: nothing a client does leaves it running.

An engine that refuses such a request (an HTTP 4xx: a custom engine without token-id prompts, a
server that requires fields the router does not know) would leave a hot prefix on its first
worker for good, every copy decided and none made. After :data:`REFUSALS_TO_STOP` refusals in a
row the router stops making copies itself, says so once in its log, and its requests make them
again, as with ``--no-router-background-copies``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from kvmesh.router.asgi.peer_auth import hop_header_map
from kvmesh.router.core.route_types import PrefixCopy
from kvmesh.router.mesh.runtime import Mesh
from kvmesh.router.request.parse import ParsedRequest
from kvmesh.router.upstream.forwarder import Refused

logger = logging.getLogger(__name__)

REFUSALS_TO_STOP = 3

COPY_ENDPOINT = "/v1/completions"
"""A prompt of token ids reproduces the prefix's blocks exactly, whatever the request's endpoint
(vLLM, SGLang and TensorRT-LLM take one there)."""


def start_prefix_copy(mesh: Mesh, copy: PrefixCopy, parsed: ParsedRequest) -> None:
    """Count the copy of ``parsed``'s first ``copy.blocks`` blocks on ``copy.worker`` now, and send
    it once the request's own dispatch has begun."""
    hashes = parsed.hashes[: copy.blocks]
    if len(hashes) < copy.blocks or copy.blocks <= 0:
        return
    n_tokens = copy.blocks * (mesh.registry.block_size or 16)
    request_id = mesh.next_request_id()
    mesh.router.track(request_id, copy.worker, hashes, n_tokens, time.monotonic(), own=True)
    mesh.spawn(_copy(mesh, request_id, copy, parsed, n_tokens))


async def _copy(mesh: Mesh, request_id: str, copy: PrefixCopy, parsed: ParsedRequest, n_tokens: int) -> None:
    outcome = "failed"
    worker_id = copy.worker[0]
    try:
        await asyncio.sleep(0)  # the request's own write goes first
        parsed.complete()  # (a request sent as another's twin is tokenized only when asked)
        tokens = parsed.tokens[:n_tokens]
        if len(tokens) == n_tokens:
            body: dict[str, Any] = {"prompt": tokens, "max_tokens": 1, "stream": False}
            model = parsed.body.get("model")
            if model is not None:  # (a LoRA adapter's name: its blocks are the adapter's)
                body["model"] = model
            # marked as routed already, so that a peer's own router serves it where it is sent
            hop = hop_header_map(mesh.settings.mesh_secret, mesh.replica, request_id)
            if await mesh.post_own(worker_id, COPY_ENDPOINT, body, hop):
                outcome = "done"
                mesh.copies_refused = 0
            else:
                logger.info("kvmesh: %s left the fleet before a background copy was sent to it", worker_id)
        else:
            logger.info("kvmesh: a shared prefix's tokens were not found: no copy sent to %s", worker_id)
    except asyncio.CancelledError:
        outcome = "cancelled"
        raise
    except Refused as e:
        logger.info("kvmesh: %s refused a background copy of a shared prefix: %s", worker_id, e)
        if 400 <= e.status < 500:
            _refused(mesh, e)
    except Exception as e:  # a copy nobody waits for must never surface
        logger.info("kvmesh: a background copy of a shared prefix on %s failed: %s", worker_id, e)
    finally:
        now = time.monotonic()
        mesh.router.finished(request_id, now)
        mesh.metrics.prefix_copies.labels(outcome).inc()
        mesh.pump(now)


def _refused(mesh: Mesh, error: Refused) -> None:
    mesh.copies_refused += 1
    if mesh.copies_refused >= REFUSALS_TO_STOP and mesh.background_copies:
        mesh.background_copies = False
        logger.warning(
            "kvmesh: the engines refused %d background copies of a shared prefix in a row (last: %s); "
            "from now on the requests routed make the copies (as with --no-router-background-copies)",
            mesh.copies_refused,
            error,
        )
