"""The fuzz suite's targets: each module gets its own standalone router and embedded mesh."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.fuzz.harness import Target, running


@pytest.fixture(scope="module", params=["standalone", "embedded"])
def target(request: pytest.FixtureRequest) -> Iterator[Target]:
    with running(request.param) as t:
        yield t
