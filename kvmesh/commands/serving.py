"""How ``kvmesh mock`` and ``kvmesh router`` take their address: bound before they say they serve.

uvicorn binds when it starts, after the command has printed where it serves: a port in use or a
host that does not resolve was said second, by uvicorn's own log, with exit status 3, under a
line claiming the server was up (a script waiting for that line went on). The socket is bound
first now, and a failure is the command's own error.
"""

from __future__ import annotations

import socket
from typing import Any

from kvmesh.errors import ConfigError


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (an IPv6 host when it has a colon, as uvicorn reads it),
    or a ConfigError naming the address and why."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as e:  # (a name that does not resolve is a gaierror, an OSError too)
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def base_url(host: str, port: int) -> str:
    """``http://host:port``, an IPv6 host in brackets."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve(app: Any, sock: socket.socket, **options: Any) -> None:
    """Run ``app`` under uvicorn on the bound ``sock`` until it is stopped."""
    import uvicorn

    uvicorn.Server(uvicorn.Config(app, **options)).run(sockets=[sock])
