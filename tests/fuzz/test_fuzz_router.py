"""Fuzz the routing path over real loopback HTTP, standalone and embedded: whatever the body and
headers, kvmesh answers no 5xx, every 4xx is an OpenAI error that names the field, and afterwards
the router is healthy, its load is back to 0 and nothing runs on the engines.

``make test`` runs a bounded number of cases; ``make fuzz`` sets ``KVMESH_FUZZ_EXAMPLES`` high and
``KVMESH_FUZZ_REPORT`` to a file that receives the figures (docs/RELIABILITY.md)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from tests.fuzz.harness import Target, examples, rss_kib, running
from tests.fuzz.strategies import CHAT, COMPLETION, HEADERS, raw_body

CASES = examples(60)
FUZZ = settings(
    max_examples=CASES,
    deadline=None,
    derandomize="KVMESH_FUZZ_EXAMPLES" not in os.environ,  # make test: the same cases every run
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    database=None,
)


@pytest.fixture(scope="module", params=["standalone", "embedded"])
def target(request: pytest.FixtureRequest) -> Iterator[Target]:
    with running(request.param) as t:
        yield t


def _check(status: int, data: bytes, body: bytes) -> None:
    assert status < 500, f"HTTP {status} for {body[:300]!r}: {data[:300]!r}"
    if status >= 400:
        doc = json.loads(data)
        error = doc["error"]
        assert error["message"], doc
        assert error["param"], f"HTTP {status} names no field for {body[:200]!r}: {doc}"


def _settled(t: Target) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if t.load() == 0 and t.engine_running() == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"load {t.load()}, engine requests {t.engine_running()} after the cases")


@pytest.mark.parametrize(
    ("path", "doc"),
    [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)],
    ids=["chat", "completions"],
)
def test_no_5xx_and_every_4xx_names_its_field(target: Target, path: str, doc: Any) -> None:
    rss_before = rss_kib()
    started = time.monotonic()

    @FUZZ
    @given(body=raw_body(doc), headers=HEADERS)
    def case(body: bytes, headers: dict[str, str]) -> None:
        status, data = target.post(path, body, headers)
        _check(status, data, body)

    case()
    _settled(target)
    assert target.get_json("/kvmesh/workers")["workers"]
    _report(target, path, rss_before, time.monotonic() - started)


def _report(t: Target, path: str, rss_before: int, secs: float) -> None:
    out = os.environ.get("KVMESH_FUZZ_REPORT")
    if not out:
        return
    row = {
        "target": t.url,
        "path": path,
        "cases": sum(t.statuses.values()),
        "statuses": dict(sorted(t.statuses.items())),
        "http_5xx": sum(n for s, n in t.statuses.items() if s >= 500),
        "rss_kib_before": rss_before,
        "rss_kib_after": rss_kib(),
        "seconds": round(secs, 1),
    }
    with open(out, "a") as f:
        f.write(json.dumps(row) + "\n")
    t.statuses.clear()
