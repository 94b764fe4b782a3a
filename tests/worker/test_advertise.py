"""kvmesh.worker.advertise: the host an engine's wildcard event sockets are advertised at."""

from __future__ import annotations

import pytest

from kvmesh.errors import ConfigError
from kvmesh.worker.advertise import advertise_host_from_env


def test_the_advertise_host_wins_then_the_self_urls_host() -> None:
    both = {"KVMESH_ADVERTISE_HOST": "gpu-7", "KVMESH_SELF_URL": "http://10.1.2.3:8000"}
    assert advertise_host_from_env(both) == "gpu-7"
    assert advertise_host_from_env({"KVMESH_SELF_URL": "http://10.1.2.3:8000"}) == "10.1.2.3"
    assert advertise_host_from_env({}) is None


def test_a_self_url_without_a_scheme_gives_its_host_as_the_router_reads_it() -> None:
    # (the router's settings take "host:port"; the URL parser alone read "10.1.2.3" as a scheme
    # and gave no host, so the wildcard endpoint went out unreachable)
    assert advertise_host_from_env({"KVMESH_SELF_URL": "10.1.2.3:8000"}) == "10.1.2.3"


def test_an_ipv6_host_is_given_as_an_endpoint_writes_it() -> None:
    assert advertise_host_from_env({"KVMESH_SELF_URL": "http://[fd00::7]:8000"}) == "[fd00::7]"
    assert advertise_host_from_env({"KVMESH_ADVERTISE_HOST": "fd00::7"}) == "[fd00::7]"
    assert advertise_host_from_env({"KVMESH_ADVERTISE_HOST": "[fd00::7]"}) == "[fd00::7]"


@pytest.mark.parametrize("bad", ["http://[::1", "http://:8000", "http://"])
def test_a_self_url_with_no_readable_host_names_the_variable(bad: str) -> None:
    # (an unclosed bracket was the URL parser's ValueError, raised at the engine's start-up)
    with pytest.raises(ConfigError, match=r"KVMESH_SELF_URL .* must look like http://host:port"):
        advertise_host_from_env({"KVMESH_SELF_URL": bad})
