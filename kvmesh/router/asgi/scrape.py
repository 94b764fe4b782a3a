"""``GET /metrics`` of an engine that serves Prometheus's multiprocess registry: kvmesh's live gauges
added to the engine's own answer.

kvmesh's per-worker, queue and event-plane gauges are read from the live routers when scraped, by a
collector in the process's default registry. An engine that serves ``/metrics`` from Prometheus's
multiprocess directory (SGLang with ``--enable-metrics``, vLLM with ``--api-server-count`` above 1)
builds its registry from the files its processes write, where nothing is read at scrape time, so
those gauges were missing. While ``PROMETHEUS_MULTIPROC_DIR`` is set the middleware lets the engine
answer, then adds the gauges to a successful answer in that answer's own format (text or
OpenMetrics) and encoding (gzip or none), keeping to the ``name[]`` filter the scrape asked for.
An answer that already carries them (a registry that includes the collector) is passed on as it is.
"""

from __future__ import annotations

import gzip
import os
import zlib
from typing import Any
from urllib.parse import parse_qs

from kvmesh._http import route_path
from kvmesh.router.mesh.metrics import LIVE_MARKER, Metrics

Message = dict[str, Any]

METRICS_PATHS = frozenset(("/metrics", "/metrics/"))
"""What vLLM's and SGLang's ``/metrics`` mount answers (a regex, so the slash needs no redirect)."""
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
_OPENMETRICS = b"application/openmetrics-text"
_EOF = b"# EOF\n"


def merges(scope: dict[str, Any]) -> bool:
    """Whether this request is a scrape of a multiprocess registry, which lacks the live gauges."""
    return (
        route_path(scope) in METRICS_PATHS
        and scope["method"] == "GET"
        and bool(os.environ.get(MULTIPROC_ENV))
    )


async def serve_with_gauges(
    app: Any, scope: dict[str, Any], receive: Any, send: Any, metrics: Metrics
) -> None:
    """Let ``app`` answer the scrape, then send its answer with the live gauges added."""
    start: Message | None = None
    chunks: list[bytes] = []

    async def hold(message: Message) -> None:
        nonlocal start
        if message["type"] == "http.response.start":
            start = message
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
        else:
            await send(message)

    await app(scope, receive, hold)
    if start is None:
        return
    body = b"".join(chunks)
    headers = list(start.get("headers", []))
    if start["status"] == 200:
        names = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("name[]", [])
        merged = with_gauges(headers, body, metrics, names)
        if merged is not None:
            body = merged
            headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
    await send({**start, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def with_gauges(
    headers: list[tuple[bytes, bytes]], body: bytes, metrics: Metrics, names: list[str]
) -> bytes | None:
    """``body`` (an exposition the engine sent with ``headers``) plus the live gauges, encoded as
    ``body`` was; None to send ``body`` unchanged (a format or encoding this does not read, or the
    gauges already there)."""
    fields = {k.lower(): v for k, v in headers}
    encoding = fields.get(b"content-encoding", b"identity").strip().lower()
    if encoding not in (b"identity", b"gzip"):
        return None
    try:
        text = gzip.decompress(body) if encoding == b"gzip" else body
    except (OSError, EOFError, zlib.error):
        return None  # not what it says it is: the engine's bytes go on untouched
    if LIVE_MARKER in text:
        return None
    content_type = fields.get(b"content-type", b"").strip().lower()
    if content_type.startswith(_OPENMETRICS):
        if not text.endswith(_EOF):
            return None
        live = metrics.render_live(names, openmetrics=True)
        text = text[: -len(_EOF)] + live[: -len(_EOF)] + _EOF
    elif content_type.startswith(b"text/plain"):
        if text and not text.endswith(b"\n"):
            text += b"\n"
        text += metrics.render_live(names)
    else:
        return None
    return gzip.compress(text) if encoding == b"gzip" else text
