"""What an engine says of itself over HTTP, for the commands that take an engine's URL instead of
its event endpoints (``kvmesh events tap URL``, ``kvmesh events relay --register URL``).

kvmesh's ``/kvmesh/info`` when the engine has it; else a stock engine's own routes, read as the
router reads them (:mod:`kvmesh.router.mesh.engine_discovery`): vLLM's ``/kv_event_sources`` with
its ``/metrics`` and ``/v1/models``, else SGLang's ``/server_info``. A ConfigError says what the
engine lacks, for the command's exit status 2.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from kvmesh.errors import ConfigError
from kvmesh.router.mesh.engine_discovery import (
    SERVER_INFO_PATH,
    SOURCES_PATH,
    NotDiscovered,
    described_sglang,
    described_vllm,
)

INFO_PATH = "/kvmesh/info"


async def read_engine(url: str, *, timeout: float = 5.0) -> tuple[dict[str, Any], str]:
    """(the engine's facts, the path they were read from): see the module docstring."""
    base = url.rstrip("/")
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as http:
            status, info = await _get(http, base + INFO_PATH)
            if status == 200:
                if not isinstance(info, dict):
                    raise ConfigError(f"{base}{INFO_PATH} is not a JSON object")
                return info, INFO_PATH
            if status != 404:
                raise ConfigError(f"{base}{INFO_PATH} answered HTTP {status}")
            status, sources = await _get(http, base + SOURCES_PATH)
            if status == 200:
                _, metrics = await _get(http, base + "/metrics", parse=False)
                _, models = await _get(http, base + "/v1/models")
                facts = described_vllm(sources, metrics if isinstance(metrics, bytes) else b"", base, models)
                return facts, SOURCES_PATH
            status, server_info = await _get(http, base + SERVER_INFO_PATH)
            if status == 200:
                return described_sglang(server_info, base), SERVER_INFO_PATH
    except NotDiscovered as e:
        raise ConfigError(f"{base}: an engine that {e}") from None
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:  # (opening the session: the rest is _get's)
        raise ConfigError(f"cannot read {base} ({e or type(e).__name__})") from None
    raise ConfigError(
        f"{base} describes itself nowhere: no {INFO_PATH} (kvmesh's), {SOURCES_PATH} (vLLM's) or "
        f"{SERVER_INFO_PATH} (SGLang's)"
    )


async def _get(http: aiohttp.ClientSession, url: str, *, parse: bool = True) -> tuple[int, Any]:
    """(status, the decoded JSON answer, or its bytes without ``parse``; None when not 200); a
    ConfigError naming ``url`` when it cannot be read."""
    from kvmesh.bench.runner import read_capped  # (here: `kvmesh --help` imports this module)

    try:
        async with http.get(url) as r:
            if r.status != 200:
                return r.status, None
            raw = await read_capped(r)
        return 200, json.loads(raw) if parse else raw
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, RecursionError) as e:
        raise ConfigError(f"cannot read {url} ({e or type(e).__name__})") from None


__all__ = ["INFO_PATH", "read_engine"]
