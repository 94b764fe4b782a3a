"""Fuzz the engines' training-loop controls over real loopback HTTP, standalone and embedded: on the
standalone router every path of kvmesh.router.asgi.fleet_control, which goes to every worker; inside
an engine's mesh, the mock engine's own. Whatever the query and the body, no 5xx, every 400 names the
field; afterwards, with the engines resumed and awake, the router serves a chat and nothing runs.

A module of its own: its targets are fresh, with no pinned prefix that would make a cache reset fail
(a reset the engine refuses is its 500, as vLLM's; kvmesh would pass it on as a 502)."""

from __future__ import annotations

from urllib.parse import urlencode

from hypothesis import given
from hypothesis import strategies as st

from kvmesh.router.asgi import fleet_control
from tests.fuzz.harness import FUZZ, Target, check_answer, reported
from tests.fuzz.strategies import CONTROL, CONTROL_QUERY, raw_body
from tests.fuzz.test_fuzz_control import NAMED, _serves_a_chat

MOCK_SERVES = {
    "/pause": "POST",
    "/resume": "POST",
    "/sleep": "POST",
    "/wake_up": "POST",
    "/is_paused": "GET",
    "/is_sleeping": "GET",
    "/pause_generation": "POST",
    "/continue_generation": "POST",
}
"""The controls the mock engine serves (kvmesh.mock.control), with their methods."""
ROUTER_SERVES = {
    **{p: "POST" for p in (*fleet_control.POSTS, *fleet_control.PER_ENGINE)},
    **{p: "GET" for p in fleet_control.GETS},
    **{p: "POST" for p in fleet_control.EITHER},
    **{p: methods[0] for p, methods in fleet_control.OTHER_METHODS.items()},
}
"""What the standalone router sends on to every worker (or refuses to), with their methods."""


def test_controls_answer_no_5xx_and_name_the_field(target: Target) -> None:
    embedded = target.url in target.engine_urls  # (the router is one of the engines' servers)
    paths = MOCK_SERVES if embedded else ROUTER_SERVES

    @FUZZ
    @given(path=st.sampled_from(sorted(paths)), query=CONTROL_QUERY, body=raw_body(CONTROL))
    def case(path: str, query: list[tuple[str, str]], body: bytes) -> None:
        method = paths[path]
        target_path = path + ("?" + urlencode(query) if query else "")
        status, data = target.call(method, target_path, body if method == "POST" else b"")
        check_answer(status, data, f"{method} {target_path} {body!r}", NAMED)

    with reported(target, "fleet controls"):
        case()
        # (whatever the cases left paused or asleep, on every engine)
        for engine in target.engine_urls:
            for path, body in (("/resume", b""), ("/wake_up", b""), ("/continue_generation", b"{}")):
                status, data = target.call("POST", path, body, url=engine)
                assert status == 200, (engine, path, data)
        _serves_a_chat(target)
