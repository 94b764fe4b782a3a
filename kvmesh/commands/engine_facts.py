"""What an engine says of itself over HTTP, for the commands that take an engine's URL instead of
its event endpoints (``kvmesh events tap URL``, ``kvmesh events relay --register URL``).

kvmesh's ``/kvmesh/info`` when the engine has it; else a stock engine's own routes, read by the
router's own reader (:func:`kvmesh.router.mesh.engine_discovery.read_stock_engine`): vLLM's
``/kv_event_sources`` with its ``/metrics`` and ``/v1/models``, else SGLang's ``/server_info``. A
ConfigError says what the engine lacks, for the command's exit status 2.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

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


async def _get(http: aiohttp.ClientSession, url: str) -> tuple[int, bytes]:
    """A whole GET, at most the answer limit: (status, body), or (0, why) when it cannot be read."""
    from kvmesh.bench.runner import read_capped  # (here: `kvmesh --help` imports this module)

    try:
        async with http.get(url) as r:
            return r.status, await read_capped(r)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        return 0, str(e or type(e).__name__).encode()


__all__ = ["INFO_PATH", "read_engine"]
