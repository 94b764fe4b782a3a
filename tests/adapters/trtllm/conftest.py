"""Fixtures for the TensorRT-LLM adapter's core tests: the fake ``tensorrt_llm`` tree on sys.path."""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

FAKE = Path(__file__).resolve().parent / "fake"


def _purge() -> None:
    for name in [m for m in sys.modules if m == "tensorrt_llm" or m.startswith("tensorrt_llm.")]:
        del sys.modules[name]


@pytest.fixture
def fake_trtllm(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The fake tensorrt_llm, freshly imported (so class patches never leak between tests)."""
    _purge()
    monkeypatch.syspath_prepend(str(FAKE))
    import tensorrt_llm

    yield tensorrt_llm
    _purge()


@pytest.fixture(autouse=True)
def _temp_files_in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher writes its merged YAML with ``tempfile``: a test's copy goes to its own
    tmp_path, not the machine's /tmp (the tests that only parse arguments never remove it)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
