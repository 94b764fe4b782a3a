"""The check a ZMQ KV-event endpoint passes before a socket opens on it: ZMQ takes a port past
65535 modulo 65,536, so a mistyped port bound or dialled another one without an error; and an
endpoint to connect to must be one ZMQ can connect, which it says only once the socket tries."""

from __future__ import annotations

import socket

import pytest

from kvmesh.errors import ConfigError
from kvmesh.events.endpoint import endpoint_problem
from kvmesh.events.publisher import BatchPublisher
from kvmesh.events.subscriber import EventSubscriber
from tests.events.eventkit import free_tcp_port


@pytest.mark.parametrize(
    ("endpoint", "bind", "problem"),
    [
        ("tcp://127.0.0.1:5557", False, None),
        ("tcp://127.0.0.1:5557", True, None),
        ("tcp://[::1]:5557", False, None),
        ("tcp://*:5557", True, None),
        ("tcp://127.0.0.1:0", True, None),
        ("tcp://127.0.0.1:*", True, None),
        ("tcp://127.0.0.1:65535", False, None),
        ("ipc:///tmp/kvmesh-events", False, None),
        ("inproc://events", True, None),
        ("tcp://eth0;10.0.0.2:5557", False, None),  # (a source interface, then the host)
        ("tcp://[fe80::1%eth0]:5557", False, None),
        ("junk", True, None),  # (a bind is left to ZMQ, which refuses it at once)
        ("junk", False, "is not a ZMQ endpoint: tcp://host:port, ipc://path or inproc://name"),
        ("tcp:/10.0.0.2:5557", False, "is not a ZMQ endpoint"),  # (one slash)
        ("http://10.0.0.2:8000", False, "is not a ZMQ endpoint"),
        ("TCP://10.0.0.2:5557", False, "is not a ZMQ endpoint"),
        ("tcp://gpu 2:5557", False, "has host 'gpu 2', which ZMQ cannot connect to"),
        ("tcp://gpu,2:5557", False, "has host 'gpu,2'"),
        ("tcp://-gpu2:5557", False, "has host '-gpu2'"),
        ("tcp://h\u00f4te:5557", False, "has host 'h\u00f4te'"),
        ("ipc://", False, "names no path"),
        ("inproc://", False, "names no inproc name"),
        ("ipc:///" + "d" * 106, False, None),
        ("ipc:///" + "d" * 107, False, "has a path of 108 bytes; a Unix socket path holds at most 107"),
        ("tcp://127.0.0.1:65536", True, "has port '65536'; a TCP port is a number from 0 to 65535"),
        ("tcp://127.0.0.1:70000", False, "has port '70000'; a TCP port is a number from 1 to 65535"),
        ("tcp://127.0.0.1:0", False, "has port '0'; a TCP port is a number from 1 to 65535"),
        ("tcp://127.0.0.1:*", False, "has port '*'"),
        ("tcp://127.0.0.1:-1", True, "has port '-1'"),
        ("tcp://127.0.0.1:5a", True, "has port '5a'"),
        ("tcp://127.0.0.1:\u00b2", True, "has port '\u00b2'"),  # a digit to str.isdigit, not to int()
        ("tcp://127.0.0.1:" + "9" * 5000, True, "has port '9999"),  # past int()'s digit limit
        ("tcp://127.0.0.1", True, "must look like tcp://host:port"),
        ("tcp://:5557", False, "must look like tcp://host:port"),
        ("tcp://*:5557", False, "names the wildcard host '*', which can be bound but not connected to"),
    ],
)
def test_endpoint_problem(endpoint: str, bind: bool, problem: str | None) -> None:
    found = endpoint_problem(endpoint, bind=bind)
    if problem is None:
        assert found is None
    else:
        assert found is not None and found.startswith(problem)


def test_a_publisher_refuses_a_port_past_65535_and_binds_nothing() -> None:
    """It bound the port modulo 65,536 and announced that one, not the port it was given."""
    port = free_tcp_port()
    with pytest.raises(ConfigError, match=rf"'tcp://127.0.0.1:{port + 65536}' has port"):
        BatchPublisher(f"tcp://127.0.0.1:{port + 65536}", bind=True)
    with socket.socket() as s:  # nothing took the port it would have wrapped to
        s.bind(("127.0.0.1", port))


@pytest.mark.parametrize(
    ("endpoint", "replay", "message"),
    [
        ("tcp://127.0.0.1:70000", None, "KV-event endpoint 'tcp://127.0.0.1:70000' has port"),
        ("tcp://*:5557", None, "KV-event endpoint 'tcp://\\*:5557' names the wildcard host"),
        (
            "tcp://127.0.0.1:5557",
            "tcp://127.0.0.1:0",
            "KV-event replay endpoint 'tcp://127.0.0.1:0' has port",
        ),
    ],
)
def test_a_subscriber_refuses_an_endpoint_it_cannot_follow_when_made(
    endpoint: str, replay: str | None, message: str
) -> None:
    """A router makes its subscribers for a worker and starts them in the background: a bad
    endpoint failed there, unseen, and the worker's events showed as live with none arriving."""
    with pytest.raises(ConfigError, match=message):
        EventSubscriber(endpoint, lambda seq, batch: None, replay_endpoint=replay)
