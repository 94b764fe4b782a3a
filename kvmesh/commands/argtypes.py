"""argparse value types the ``kvmesh`` subcommands share: a bad value is a usage error naming the flag."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from kvmesh.events.endpoint import endpoint_problem


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def port(text: str) -> int:
    """A TCP port to listen on. (Past 65535 the server announced the port given and listened on
    that port modulo 65,536; below 1 the socket layer's "Servname not supported" came after
    start-up.)"""
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port from 1 to 65535, got {value}")
    return value


def listen_host(text: str) -> str:
    """The address a server listens on. (An empty one listened on every interface, where the help
    says only the address given is bound.)"""
    value = text.strip()
    if not value:
        raise argparse.ArgumentTypeError(
            "must name an address, e.g. 127.0.0.1, or 0.0.0.0 for every interface"
        )
    return value


def http_url(text: str) -> str:
    """An engine's or a server's base URL, as ``kvmesh router --workers`` takes it (``host:port`` or
    ``http(s)://host:port``), in the form kvmesh writes it."""
    from kvmesh.errors import ConfigError
    from kvmesh.router.mesh.settings import normalize_url  # (here, not at import: --help stays quick)

    try:
        return normalize_url(text, "URL")
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def bind_endpoint(text: str) -> str:
    """A ZMQ endpoint to bind (a ``tcp://`` port past 65535 was bound modulo 65,536)."""
    return _endpoint(text, bind=True)


def connect_endpoint(text: str) -> str:
    """A ZMQ endpoint to connect to (a ``tcp://`` port past 65535 dialled another port)."""
    return _endpoint(text, bind=False)


def _endpoint(text: str, *, bind: bool) -> str:
    problem = endpoint_problem(text, bind=bind)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{text!r} {problem}")
    return text


LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
"""uvicorn's log levels (its ``LOG_LEVELS``; a name outside them was a KeyError at start-up)."""


def log_level(text: str) -> str:
    value = text.lower()
    if value not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(LOG_LEVELS)}, got {text!r}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0, got {text}")
    if not math.isfinite(value):  # a rate, a duration or a timeout: infinity means nothing here
        raise argparse.ArgumentTypeError(f"must be finite, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number of at least 0, got {text}")
    return value


def share(text: str) -> float:
    """A share of a whole: a number from 0 to 1."""
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def positive_ints(text: str) -> list[int]:
    """Comma-separated integers of at least 1, such as ``16,64``."""
    try:
        values = [int(item) for item in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers of at least 1, got {text!r}")
    return values


def output_path(text: str) -> str:
    """A file the command writes when it is done ('' for none): its directory must exist and it
    must not be a directory itself, checked before the run rather than after it."""
    if text:
        path = Path(text)
        if path.is_dir():
            raise argparse.ArgumentTypeError(f"{text} is a directory, not a file")
        parent = path.resolve().parent
        if not parent.is_dir():
            raise argparse.ArgumentTypeError(f"directory {parent} does not exist")
    return text
