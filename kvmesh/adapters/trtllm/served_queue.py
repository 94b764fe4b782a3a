"""A stock trtllm-serve's KV-event queue, read from outside the engine over its ``POST
/kv_cache_events`` (for ``kvmesh events trtllm``).

trtllm-serve's handler drains ``get_kv_cache_events_async`` and answers the events as a JSON list
(1.0 and 1.1 wait up to 2 s for the first when the queue is empty; newer versions answer at once).
:meth:`ServedEventQueue.drain` is one such answer, for a bridge without an engine. Whatever else
posts to that route takes events from the same queue; the event ids then jump and the converter
re-syncs the routers.

:func:`block_size_seen` reads, from the blocks the engine stored, whether they hold the number of
tokens the bridge was told: with another block size it would publish nothing (every block looks
like a prompt's tail) or drop every block (too long), silently.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable
from typing import Any

import aiohttp

EVENTS_PATH = "/kv_cache_events"
ANSWER_LIMIT = 64 * 1024 * 1024
"""The largest answer read: an engine's whole buffer of events is a few MB; more is no answer."""


class EngineUnreachable(Exception):
    """The engine did not answer this time (down, restarting, or an answer that is no event list)."""


class NotServingEvents(Exception):
    """The server at the URL has no ``POST /kv_cache_events``: no trtllm-serve, or one too old."""


class ServedEventQueue:
    """``POST {url}/kv_cache_events`` as an engine's event queue."""

    def __init__(self, url: str, *, timeout: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self._http: aiohttp.ClientSession | None = None

    async def drain(self) -> list[Any]:
        """One answer's events; EngineUnreachable, or NotServingEvents for a 404 or 405."""
        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout))
        target = self.url + EVENTS_PATH
        try:
            async with self._http.post(target) as r:
                if r.status in (404, 405):
                    raise NotServingEvents(
                        f"{self.url} answers POST {EVENTS_PATH} with HTTP {r.status}: it is no trtllm-serve "
                        "(or one without that route)"
                    )
                if r.status != 200:
                    raise EngineUnreachable(f"POST {target} answered HTTP {r.status}")
                if (r.content_length or 0) > ANSWER_LIMIT:
                    raise EngineUnreachable(f"POST {target} answered {r.content_length} bytes")
                body = await r.content.read(ANSWER_LIMIT + 1)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            raise EngineUnreachable(f"POST {target}: {e or type(e).__name__}") from None
        if len(body) > ANSWER_LIMIT:
            raise EngineUnreachable(f"POST {target} answered more than {ANSWER_LIMIT} bytes")
        try:
            events = json.loads(body)
        except (ValueError, RecursionError):
            raise EngineUnreachable(f"POST {target} answered no JSON") from None
        if not isinstance(events, list):
            raise EngineUnreachable(f"POST {target} answered {type(events).__name__}, not a list of events")
        return events

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None


def block_size_seen(events: Iterable[Any], block_size: int) -> int | None:
    """The block size the engine's ``stored`` events show when it is not ``block_size``, else None.

    A stored chain's blocks are all full but the last (a prompt's tail is stored short), so a
    block longer than ``block_size``, or a short one before the last, gives the engine's size
    away. (A lone short block says nothing: it may be a tail.)"""
    for event in events:
        data = event.get("data") if isinstance(event, dict) else None
        blocks = data.get("blocks") if isinstance(data, dict) and data.get("type") == "stored" else None
        if not isinstance(blocks, list):
            continue
        sizes = [
            len(b["tokens"]) for b in blocks if isinstance(b, dict) and isinstance(b.get("tokens"), list)
        ]
        for i, size in enumerate(sizes):
            if size > block_size or (size != block_size and i < len(sizes) - 1 and size > 0):
                return size
    return None


__all__ = ["EngineUnreachable", "NotServingEvents", "ServedEventQueue", "block_size_seen"]
