"""vLLM 0.33.0's paths that the standalone router relays to one worker (engine tier): each is on
vLLM's own routers, with the method the router takes, and in the router's list.

Speech to text (``/v1/audio/transcriptions``, ``/v1/audio/translations``: a form with the audio),
System One decisions (``/v1/systemone``) and generative scores (``/generative_scoring``) go as the
pooling requests do (kvmesh/router/asgi/pooling.py): they share no prefix to route on.
"""

from __future__ import annotations

import warnings

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # torch's, at import
    from vllm.entrypoints.generate.generative_scoring.api_router import router as scoring
    from vllm.entrypoints.generate.structured_decisions.api_router import router as decisions
    from vllm.entrypoints.speech_to_text.transcription.api_router import router as transcription
    from vllm.entrypoints.speech_to_text.translation.api_router import router as translation

from kvmesh.router.asgi import pooling

pytestmark = pytest.mark.engine_vllm


def test_vllms_scoring_and_speech_paths_are_relayed_with_their_method() -> None:
    posts = {r.path for router in (scoring, decisions) for r in router.routes if "POST" in r.methods}
    assert posts == {"/generative_scoring", "/v1/systemone"}
    speech = {r.path for router in (transcription, translation) for r in router.routes if "POST" in r.methods}
    assert speech == {"/v1/audio/transcriptions", "/v1/audio/translations"}
    assert posts | speech <= set(pooling.PATHS)
    assert speech == set(pooling.FORM_PATHS)  # (read as forms, not JSON)


def test_vllms_tokenizer_info_is_relayed_with_its_method() -> None:
    """``vllm serve --enable-tokenizer-info-endpoint`` adds ``GET /tokenizer_info``: the router
    relays it to one worker, as it relays the tokenizer's other paths."""
    import argparse

    from fastapi import FastAPI
    from vllm.entrypoints.serve.tokenize import api_router as tokenize_api

    from kvmesh.router.asgi import any_worker

    app = FastAPI()
    app.state.args = argparse.Namespace(enable_tokenizer_info_endpoint=True)
    tokenize_api.attach_router(app)  # (adds the route to vLLM's tokenizer router, then mounts it)
    gets = {r.path for r in tokenize_api.router.routes if "GET" in r.methods}
    assert gets == {"/tokenizer_info"}
    assert "/tokenizer_info" in any_worker.READ_PATHS
