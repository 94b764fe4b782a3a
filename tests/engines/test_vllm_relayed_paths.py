"""vLLM 0.33.0's paths that the standalone router relays to one worker (engine tier): each is on
vLLM's own routers, with the method the router takes, and in the router's list.

Speech to text (``/v1/audio/transcriptions``, ``/v1/audio/translations``: a form with the audio),
System One decisions (``/v1/systemone``) and generative scores (``/generative_scoring``) go as the
pooling requests do (kvmesh/router/asgi/pooling.py): they share no prefix to route on. vLLM's
speech-to-text routers need ``python-multipart`` to import, which the tier's environment does not
install: their paths are read from their source.
"""

from __future__ import annotations

import importlib.util
import re
import warnings
from pathlib import Path

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # torch's, at import
    from vllm.entrypoints.generate.generative_scoring.api_router import router as scoring
    from vllm.entrypoints.generate.structured_decisions.api_router import router as decisions

from kvmesh.router.asgi import pooling

pytestmark = pytest.mark.engine_vllm


def _posted_in_source(module: str) -> set[str]:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None
    return set(re.findall(r'@router\.post\(\s*"([^"]+)"', Path(spec.origin).read_text()))


def test_vllms_scoring_and_speech_paths_are_relayed_with_their_method() -> None:
    posts = {r.path for router in (scoring, decisions) for r in router.routes if "POST" in r.methods}
    assert posts == {"/generative_scoring", "/v1/systemone"}
    speech = {
        path
        for kind in ("transcription", "translation")
        for path in _posted_in_source(f"vllm.entrypoints.speech_to_text.{kind}.api_router")
    }
    assert speech == {"/v1/audio/transcriptions", "/v1/audio/translations"}
    assert posts | speech <= set(pooling.PATHS)
    assert speech == set(pooling.FORM_PATHS)  # (read as forms, not JSON)
