"""The vLLM adapter's engine-free parts, in the dev venv (no vLLM installed or needed)."""

from __future__ import annotations

import sys
from argparse import Namespace
from typing import Any

import msgspec
import pytest

from kvmesh.adapters.session_tag import tag_session
from kvmesh.adapters.vllm._vllm import import_vllm
from kvmesh.adapters.vllm.endpoints import VllmWorkerBackend, advertise_host_from_env
from kvmesh.adapters.vllm.engine_rpc import pin_budget_from_env
from kvmesh.errors import ConfigError


def test_a_missing_vllm_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError, installed or not
    with pytest.raises(ImportError, match=r"pip install 'kvmesh\[vllm\]'"):
        import_vllm()


def test_importing_the_adapter_does_not_import_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--middleware kvmesh.adapters.vllm.KvMeshMiddleware`` and the entry points import these
    modules; vLLM must only be imported when a hook actually runs."""
    import importlib

    monkeypatch.setitem(sys.modules, "vllm", None)
    for name in [m for m in sys.modules if m.startswith("kvmesh.adapters.vllm")]:
        monkeypatch.delitem(sys.modules, name)
    for module in ("", ".plugin", ".endpoints", ".publisher", ".engine_rpc", ".middleware", ".tokenizer"):
        importlib.import_module("kvmesh.adapters.vllm" + module)


@pytest.mark.parametrize(
    ("env", "expected"),
    [({}, 0.25), ({"KVMESH_PIN_BUDGET": "0.5"}, 0.5), ({"KVMESH_PIN_BUDGET": "0"}, 0.0)],
)
def test_pin_budget_from_env(env: dict[str, str], expected: float) -> None:
    assert pin_budget_from_env(env) == expected


@pytest.mark.parametrize("bad", ["1.5", "-0.1", "half", "nan"])
def test_pin_budget_must_be_a_fraction(bad: str) -> None:
    with pytest.raises(
        ConfigError, match=f"KVMESH_PIN_BUDGET must be a fraction between 0 and 1, got '{bad}'"
    ):
        pin_budget_from_env({"KVMESH_PIN_BUDGET": bad})


def test_wildcard_event_endpoints_are_advertised_at_the_engines_own_host() -> None:
    host = advertise_host_from_env({"KVMESH_SELF_URL": "http://10.1.2.3:8000"})
    assert host == "10.1.2.3"
    assert (
        advertise_host_from_env({"KVMESH_ADVERTISE_HOST": "gpu-7", "KVMESH_SELF_URL": "http://x:1"})
        == "gpu-7"
    )
    assert advertise_host_from_env({}) is None
    backend = VllmWorkerBackend(engine_client=None, args=Namespace(), advertise_host=host)
    assert backend._reachable("tcp://*:5557") == "tcp://10.1.2.3:5557"
    assert backend._reachable("tcp://0.0.0.0:5558") == "tcp://10.1.2.3:5558"
    assert backend._reachable("tcp://10.9.9.9:5557") == "tcp://10.9.9.9:5557"
    assert backend._reachable("ipc:///tmp/ev") == "ipc:///tmp/ev"


def _scope(body: bytes, extra: list[tuple[bytes, bytes]] | None = None) -> dict[str, Any]:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    return {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "headers": headers + (extra or []),
    }


def _receiver(chunks: list[bytes]) -> Any:
    messages = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)
    ]
    messages.append({"type": "http.disconnect"})
    it = iter(messages)

    async def receive() -> dict[str, Any]:
        return next(it)

    return receive


async def _drain(receive: Any) -> tuple[bytes, list[bool]]:
    body, flags = b"", []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return body, flags
        body += message["body"]
        flags.append(message.get("more_body", False))
        if not message.get("more_body", False):
            return body, flags


async def test_a_session_request_gets_vllms_session_header_and_its_body_replayed_unchanged() -> None:
    body = msgspec.json.encode(
        {"messages": [], "nvext": {"session_control": {"session_id": "s-1", "action": "open"}}}
    )
    chunks = [body[:10], body[10:]]
    scope, receive = await tag_session(_scope(body), _receiver(chunks), limit=1 << 20)
    assert (b"x-session-id", b"s-1") in scope["headers"]
    assert await _drain(receive) == (body, [True, False])
    assert (await receive())["type"] == "http.disconnect"  # later messages come from the client


@pytest.mark.parametrize(
    ("body", "extra", "limit"),
    [
        pytest.param(b'{"messages": []}', None, 1 << 20, id="no-session"),
        pytest.param(b'{"nvext": {"session_control": {"session_id": 7}}}', None, 1 << 20, id="not-a-string"),
        pytest.param(b'{"nvext": {"session_control": "x"', None, 1 << 20, id="malformed"),
        pytest.param(
            b'{"nvext": {"session_control": {"session_id": "a"}}}',
            [(b"x-session-id", b"mine")],
            1 << 20,
            id="client-set",
        ),
        pytest.param(b'{"nvext": {"session_control": {"session_id": "a"}}}', None, 5, id="too-large"),
    ],
)
async def test_requests_without_a_usable_session_pass_untouched(
    body: bytes, extra: list[tuple[bytes, bytes]] | None, limit: int
) -> None:
    scope = _scope(body, extra)
    tagged, receive = await tag_session(scope, _receiver([body]), limit=limit)
    assert [h for h in tagged["headers"] if h[0] == b"x-session-id"] == (extra or [])
    assert (await _drain(receive))[0] == body
