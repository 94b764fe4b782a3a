"""The host an engine's KV-event sockets are advertised at when they bind a wildcard address.

An engine binds its publisher to ``tcp://*:5557``; a router on another host cannot connect to
``*``, so the endpoint it is told about names the engine's own host: ``KVMESH_ADVERTISE_HOST``
when set, else the host of ``KVMESH_SELF_URL`` (the engine's own base URL, which the router's
settings read too, in the same forms: ``host:port`` or ``http://host:port``). Shared by the
adapters, which each read it at start-up.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from urllib.parse import urlsplit

from kvmesh.errors import ConfigError
from kvmesh.events.endpoint import bound_to_every_interface


def advertise_host_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """``KVMESH_ADVERTISE_HOST``, else ``KVMESH_SELF_URL``'s host, else None; an IPv6 address in
    brackets, for ``tcp://[::1]:5557``. ConfigError naming the variable when ``KVMESH_SELF_URL`` has
    no host that can be read."""
    env = os.environ if environ is None else environ
    host = env.get("KVMESH_ADVERTISE_HOST") or _self_url_host(env)
    if host is None:
        return None
    # (an IPv6 address as an endpoint writes it; ``tcp://fd00::7:5557`` names no port)
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _self_url_host(env: Mapping[str, str]) -> str | None:
    url = (env.get("KVMESH_SELF_URL") or "").strip()
    if not url:
        return None
    try:  # (schemeless, as the router's settings take it; urlsplit would read "host" as a scheme)
        host = urlsplit(url if "://" in url else "http://" + url).hostname
    except ValueError:  # (an unclosed or invalid bracketed IPv6 host)
        host = None
    if not host:
        raise ConfigError(f"KVMESH_SELF_URL {url!r} must look like http://host:port")
    return host


def reachable(endpoint: str, host: str | None) -> str:
    """A ``tcp://`` endpoint bound to every interface as a peer can dial it: its host replaced by
    ``host`` (:func:`advertise_host_from_env`), when there is one."""
    if host is None or not bound_to_every_interface(endpoint):
        return endpoint
    return f"tcp://{host}:{endpoint.rpartition(':')[2]}"
