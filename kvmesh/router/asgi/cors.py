"""Cross-origin access to the standalone router, for a client running in a browser page served
from another origin (a chat UI, a notebook front end, an editor's webview).

A browser sends such a page's requests only after a preflight (``OPTIONS`` with the method and
headers it means to use) that the server answers with ``Access-Control-Allow-*`` headers, and lets
the page read an answer only when it carries them. SGLang allows every origin, and vLLM those given
to ``--allowed-origins``; a page pointed at an engine directly worked, and pointed at the router it
did not: nothing answered the preflight.

``kvmesh router --allowed-origins`` (with vLLM's names for the other three settings) wraps the
router in Starlette's CORS middleware, so its own answers carry the headers too: a 400 naming a
field, a 503 with ``Retry-After``, ``/metrics``. The browser's ``Origin`` is then taken off the
request before it reaches the router: a worker never sees it, so an engine's own CORS policy
(SGLang's allows everything, with credentials) adds nothing to what the router relays, and the
client reads the router's policy alone. Without the flag nothing changes (the default, as vLLM's).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from starlette.middleware.cors import CORSMiddleware

from kvmesh.errors import ConfigError

_ORIGIN = re.compile(r"^[a-z][a-z0-9+.-]*://[^/?#\s]+$")
_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
"""RFC 9110's token: a method or a header name."""


@dataclass(frozen=True)
class CorsPolicy:
    """What ``kvmesh router`` allows a browser page from another origin; no origins: CORS off."""

    origins: tuple[str, ...] = ()
    methods: tuple[str, ...] = ("*",)
    headers: tuple[str, ...] = ("*",)
    credentials: bool = False

    @property
    def enabled(self) -> bool:
        return bool(self.origins)


def check_origin(text: str) -> str:
    """An origin as a browser sends it (``scheme://host[:port]``), or ``*``; ConfigError otherwise.
    (An origin with a path or a trailing slash would never match the ``Origin`` header.)"""
    value = text.strip()
    if value == "*":
        return value
    lowered = value.lower()
    if not _ORIGIN.match(lowered):
        hint = " (no trailing slash: a browser sends none)" if lowered.rstrip("/") != lowered else ""
        raise ConfigError(f"{text!r} is not an origin: write scheme://host[:port]{hint}, or * for any")
    return lowered


def check_token(text: str, what: str) -> str:
    """An HTTP method or header name (RFC 9110's token), or ``*``; ConfigError otherwise."""
    value = text.strip()
    if value != "*" and not _TOKEN.match(value):
        raise ConfigError(f"{text!r} is not an HTTP {what}")
    return value


def with_cors(app: Any, policy: CorsPolicy) -> Any:
    """``app`` answering cross-origin requests as ``policy`` allows (``app`` itself when CORS is
    off); the ``Origin`` header is dropped before ``app`` sees a request (see the module docstring)."""
    if not policy.enabled:
        return app
    return CORSMiddleware(
        _without_origin(app),
        allow_origins=list(policy.origins),
        allow_methods=_upper(policy.methods),
        allow_headers=list(policy.headers),
        allow_credentials=policy.credentials,
    )


def _upper(methods: Sequence[str]) -> list[str]:
    return [m if m == "*" else m.upper() for m in methods]


def _without_origin(app: Any) -> Any:
    async def dropping(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = scope["headers"]
            if any(k == b"origin" for k, _ in headers):
                scope = {**scope, "headers": [(k, v) for k, v in headers if k != b"origin"]}
        await app(scope, receive, send)

    return dropping
