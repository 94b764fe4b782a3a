"""Client-side helpers for the HTTP tests of the router."""

from __future__ import annotations

from typing import Any

import aiohttp


async def stream_chat(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> None:
    """A streamed chat completion through ``url``, read to its end (or until it is cancelled)."""
    async with http.post(url + "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status == 200
        async for _ in r.content:
            pass
