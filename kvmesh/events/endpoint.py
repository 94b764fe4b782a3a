"""The check a ``tcp://`` KV-event endpoint passes before a socket is opened on it.

ZMQ takes a TCP port past 65535 and uses it modulo 65,536: ``tcp://127.0.0.1:70000`` binds or
dials port 4464, without an error. A publisher then announced a port it did not listen on, and a
router told of a mistyped port followed another stream, or none, while showing the worker's
events as live. Other transports (``ipc://``, ``inproc://``, NATS subjects) are left to their own
rules.
"""

from __future__ import annotations

from kvmesh.errors import ConfigError

_TCP = "tcp://"
_MAX_PORT = 65535


def endpoint_problem(endpoint: str, *, bind: bool) -> str | None:
    """What is wrong with a ``tcp://host:port`` endpoint to bind (port 0 or ``*``: any free one)
    or to connect to (a port from 1, and a host that is not the wildcard), or None."""
    if not endpoint.startswith(_TCP):
        return None
    host, sep, port = endpoint.removeprefix(_TCP).rpartition(":")
    if not sep or not host:
        return "must look like tcp://host:port"
    if bind and port == "*":
        return None
    low = 0 if bind else 1
    number = int(port) if port.isascii() and port.isdigit() and len(port) <= 5 else -1
    if not low <= number <= _MAX_PORT:
        return f"has port {port!r}; a TCP port is a number from {low} to {_MAX_PORT}"
    if not bind and host == "*":
        return "names the wildcard host '*', which can be bound but not connected to"
    return None


def check_endpoint(endpoint: str, *, bind: bool, what: str = "KV-event endpoint") -> str:
    """The endpoint, or a ConfigError naming it and what is wrong."""
    problem = endpoint_problem(endpoint, bind=bind)
    if problem is not None:
        raise ConfigError(f"{what} {endpoint!r} {problem}")
    return endpoint
