"""The check a ZMQ KV-event endpoint passes before a socket is opened on it.

ZMQ takes a TCP port past 65535 and uses it modulo 65,536: ``tcp://127.0.0.1:70000`` binds or
dials port 4464, without an error. A publisher then announced a port it did not listen on, and a
router told of a mistyped port followed another stream, or none, while showing the worker's
events as live.

An endpoint to connect to is also held to what ZMQ will connect: a transport kvmesh speaks and a
host or path it can parse. A router told ``tcp:/10.0.0.2:5557`` (one slash) in its config, or by a
worker's ``/kvmesh/info``, had its subscription fail on the first connect inside a task nobody
awaited: the worker's events showed as live and none came. A bad replay endpoint failed only at
the first gap, and then cut the live stream at every retry. A bind is left to ZMQ, which refuses
at once and is reported by the publisher.
"""

from __future__ import annotations

from kvmesh.errors import ConfigError

_TCP = "tcp://"
_MAX_PORT = 65535
_TRANSPORTS = ("tcp://", "ipc://", "inproc://")
_IPC_PATH_MAX = 107
"""The longest ``ipc://`` path: a Unix socket address holds 108 bytes with its terminator."""
_HOST_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-_:[]%;")
"""A name, IPv4 or ``[IPv6]`` (with a ``%zone``), or ``source;host``: ZMQ refused a connect to
anything else (a space, ``/``, ``,``, ``@``, a non-ASCII letter) as an invalid argument."""
_SHAPES = "a ZMQ endpoint: tcp://host:port, ipc://path or inproc://name"
_WILDCARD_BINDS = ("tcp://*:", "tcp://0.0.0.0:", "tcp://[::]:")


def bound_to_every_interface(endpoint: str) -> bool:
    """Whether ``endpoint`` is a ``tcp://`` bind to every interface (``*``, ``0.0.0.0``, ``[::]``):
    an engine tells routers its own host instead, since a router dials its own host there."""
    return endpoint.startswith(_WILDCARD_BINDS)


def endpoint_problem(endpoint: str, *, bind: bool) -> str | None:
    """What is wrong with an endpoint to bind (a ``tcp://`` port of 0 or ``*``: any free one; the
    rest is ZMQ's to refuse) or to connect to (a transport kvmesh speaks; for ``tcp://``, a port
    from 1 and a host ZMQ parses that is not the wildcard), or None."""
    if not bind and not endpoint.startswith(_TRANSPORTS):
        return f"is not {_SHAPES}"
    if not endpoint.startswith(_TCP):
        return None if bind else _local_problem(endpoint)
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
    if not bind and (host.startswith("-") or not set(host) <= _HOST_CHARS):
        return f"has host {host!r}, which ZMQ cannot connect to"
    return None


def needs_ipv6(endpoint: str, *, bind: bool) -> bool:
    """Whether a socket needs ZMQ's IPv6 option on to bind or reach ``endpoint``.

    ZMQ sockets speak IPv4 alone unless told: a bind to ``tcp://[::]:5557`` failed ("No such
    device"), and a connect to ``tcp://[fd00::7]:5557`` was taken and never made, so a router
    followed no event from an engine on an IPv6 address (the one vLLM's own publisher, told
    ``tcp://*:0``, binds on a node whose IP is IPv6, or the one kvmesh advertises from an IPv6
    ``KVMESH_SELF_URL``).
    On for an IPv6 address, and for a bind to every interface (``*``), which then takes IPv4 and
    IPv6 peers both (where the host has no IPv6, libzmq's source falls back to IPv4: not tried
    here, as this machine has IPv6). Off for a host name, which ZMQ would then resolve to its IPv6
    address first (``localhost`` to ``::1``) and miss a publisher bound on IPv4."""
    if not endpoint.startswith(_TCP):
        return False
    host = endpoint.removeprefix(_TCP).rpartition(":")[0].rpartition(";")[2]
    return host.startswith("[") or (bind and host == "*")


def _local_problem(endpoint: str) -> str | None:
    """What is wrong with an ``ipc://`` or ``inproc://`` endpoint to connect to, or None."""
    transport, _, name = endpoint.partition("://")
    if not name:
        return f"names no {'path' if transport == 'ipc' else 'inproc name'}"
    if transport == "ipc" and len(name.encode()) > _IPC_PATH_MAX:
        return f"has a path of {len(name.encode())} bytes; a Unix socket path holds at most {_IPC_PATH_MAX}"
    return None


def check_endpoint(endpoint: str, *, bind: bool, what: str = "KV-event endpoint") -> str:
    """The endpoint, or a ConfigError naming it and what is wrong."""
    problem = endpoint_problem(endpoint, bind=bind)
    if problem is not None:
        raise ConfigError(f"{what} {endpoint!r} {problem}")
    return endpoint
