"""How a command ends when what it was given cannot work: the reason on stderr, naming the command,
and exit status 2, as argparse ends on a bad flag (never a traceback, never status 1, which says
the command ran and failed)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Coroutine
from typing import Any

from kvmesh.errors import ConfigError

USAGE_ERROR = 2


def refuse(command: str, error: BaseException) -> int:
    """Say why ``command`` cannot run; the exit status to return."""
    print(f"{command}: {error}", file=sys.stderr)
    return USAGE_ERROR


def run_async(command: str, main: Coroutine[Any, Any, int]) -> int:
    """Run ``main`` to its exit status; a ConfigError raised on the way is a refusal."""
    try:
        return asyncio.run(main)
    except ConfigError as e:
        return refuse(command, e)
