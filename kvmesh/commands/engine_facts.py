"""What an engine says of itself over HTTP, for the commands that take an engine's URL instead of
its event endpoints (``kvmesh events tap URL``, ``kvmesh events relay --register URL``).

kvmesh's ``/kvmesh/info`` when the engine has it; else a stock engine's own routes, read by the
router's own reader (:func:`kvmesh.router.mesh.engine_discovery.read_stock_engine`): vLLM's
``/kv_event_sources`` with its ``/metrics`` and ``/v1/models``, else SGLang's ``/server_info``. A
ConfigError says what the engine lacks, for the command's exit status 2. :func:`event_endpoints`
reads the endpoints each DP rank publishes on from what was read.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

import aiohttp

from kvmesh.commands.argtypes import connect_endpoint
from kvmesh.errors import ConfigError
from kvmesh.router.mesh.engine_discovery import NoRoutes, NotDiscovered, read_stock_engine

INFO_PATH = "/kvmesh/info"


async def read_engine(url: str, *, timeout: float = 5.0) -> tuple[dict[str, Any], str]:
    """(the engine's facts, the path they were read from): see the module docstring."""
    base = url.rstrip("/")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as http:

        async def get(path: str) -> tuple[int, bytes]:
            return await _get(http, base + path)

        status, body = await get(INFO_PATH)
        if status == 0:
            raise ConfigError(f"cannot read {base}{INFO_PATH} ({body.decode('utf-8', 'replace')})")
        if status == 200:
            try:
                info = json.loads(body)
            except (ValueError, RecursionError):
                info = None
            if not isinstance(info, dict):
                raise ConfigError(f"{base}{INFO_PATH} is not a JSON object")
            return info, INFO_PATH
        if status != 404:
            raise ConfigError(f"{base}{INFO_PATH} answered HTTP {status}")
        try:
            return await read_stock_engine(get, base)
        except NoRoutes as e:
            raise ConfigError(f"{base} describes itself nowhere: no {INFO_PATH} (kvmesh's), {e}") from None
        except NotDiscovered as e:
            raise ConfigError(f"{base}: {e}") from None


def event_endpoints(facts: dict[str, Any], url: str, where: str) -> tuple[list[str], list[str | None]]:
    """The PUB endpoint of each DP rank an engine's description (``facts``, read from ``where``)
    names, and its replay endpoint where the description has one, to connect to; ConfigError when
    it names none, or one kvmesh cannot dial (already on NATS, say)."""
    endpoints = facts.get("kv_events_endpoints")
    if not isinstance(endpoints, list) or not endpoints:
        raise ConfigError(f"{url} publishes no KV events (its {where} names no endpoint)")
    replays = facts.get("kv_replay_endpoints")
    replays = replays if isinstance(replays, list) else []
    try:
        return [connect_endpoint(str(e)) for e in endpoints], [
            connect_endpoint(str(replays[r])) if r < len(replays) and replays[r] else None
            for r in range(len(endpoints))
        ]
    except argparse.ArgumentTypeError as e:
        raise ConfigError(f"{url}'s {where} names an endpoint kvmesh cannot dial: {e}") from None


async def _get(http: aiohttp.ClientSession, url: str) -> tuple[int, bytes]:
    """A whole GET, at most the answer limit: (status, body), or (0, why) when it cannot be read."""
    from kvmesh.bench.runner import read_capped  # (here: `kvmesh --help` imports this module)

    try:
        async with http.get(url) as r:
            return r.status, await read_capped(r)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        return 0, str(e or type(e).__name__).encode()


__all__ = ["INFO_PATH", "event_endpoints", "read_engine"]
