"""Run-time LoRA loads through the standalone router, in front of vLLM 0.33.0's own
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (engine tier;
kvmesh/router/asgi/fleet_control.py).

vLLM registers the two routes with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``, wrapped in the
decorators of ``model-hosting-container-standards`` (SageMaker's adapter API), which the tier's
environment does not install: a stand-in whose decorators change nothing lets vLLM's own
``_attach_router`` register them. What needs a model, vLLM's serving models, is a recorder of the
calls its handlers make. Through the router, a load must reach every engine as vLLM parses it, and
the router must route the adapter's requests to them from its answer on.
"""

from __future__ import annotations

import contextlib
import sys
import types
import warnings
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # torch's, at import
    import httpx
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse
    from vllm.entrypoints.serve.lora import api_router as lora_api

from kvmesh.router.asgi import fleet_control
from tests.engines.test_vllm_fleet_control import router_in_front

pytestmark = pytest.mark.engine_vllm


class RecordingModels:
    """vLLM's serving models as the LoRA handlers call them: the adapters loaded, recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.adapters: set[str] = set()

    async def load_lora_adapter(self, request: Any) -> str:
        self.calls.append(("load", (request.lora_name, request.lora_path, request.load_inplace)))
        self.adapters.add(request.lora_name)
        return f"Success: LoRA adapter '{request.lora_name}' added successfully."

    async def unload_lora_adapter(self, request: Any) -> str:
        self.calls.append(("unload", request.lora_name))
        self.adapters.discard(request.lora_name)
        return f"Success: LoRA adapter '{request.lora_name}' removed successfully."


@contextlib.contextmanager
def _sagemaker_decorators_that_change_nothing() -> Iterator[None]:
    def factory(*_args: Any, **_kwargs: Any) -> Any:
        return lambda handler: handler

    standards = types.ModuleType("model_hosting_container_standards")
    sagemaker = types.ModuleType("model_hosting_container_standards.sagemaker")
    sagemaker.register_load_adapter_handler = factory  # type: ignore[attr-defined]
    sagemaker.register_unload_adapter_handler = factory  # type: ignore[attr-defined]
    standards.sagemaker = sagemaker  # type: ignore[attr-defined]
    names = ("model_hosting_container_standards", "model_hosting_container_standards.sagemaker")
    saved = {name: sys.modules.get(name) for name in names}
    sys.modules.update(zip(names, (standards, sagemaker), strict=True))
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def _vllm_app(recorder: RecordingModels) -> FastAPI:
    app = FastAPI()
    with _sagemaker_decorators_that_change_nothing():
        lora_api._attach_router(app)  # (what attach_router does with runtime LoRA updating on)
    app.state.openai_serving_models = recorder

    @app.get("/v1/models")
    async def models() -> JSONResponse:  # (vLLM lists an adapter with its base model as parent)
        adapters = [{"id": a, "object": "model", "parent": "m"} for a in sorted(recorder.adapters)]
        return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model"}, *adapters]})

    return app


@contextlib.asynccontextmanager
async def _fleet() -> AsyncIterator[tuple[httpx.AsyncClient, list[RecordingModels]]]:
    recorders = [RecordingModels(), RecordingModels()]
    async with router_in_front(*(_vllm_app(r) for r in recorders)) as http:
        yield http, recorders


def test_vllms_lora_routes_are_the_ones_the_router_sends_to_every_worker() -> None:
    _vllm_app(RecordingModels())  # (vLLM registers them on its module's router, then includes it)
    posts = {r.path for r in lora_api.router.routes if "POST" in getattr(r, "methods", ())}
    assert {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} <= posts
    assert {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} <= set(fleet_control.ADAPTER_LOADS)


async def test_a_lora_load_reaches_every_vllm_engine_and_its_adapter_is_routable_at_once() -> None:
    async with _fleet() as (http, recorders):
        body = {"lora_name": "sql-lora", "lora_path": "/adapters/sql", "load_inplace": True}
        r = await http.post("/v1/load_lora_adapter", json=body)
        assert r.status_code == 200, r.text
        assert set(r.json()["workers"]) == {"w0", "w1"}
        assert [rec.calls for rec in recorders] == [[("load", ("sql-lora", "/adapters/sql", True))]] * 2
        listed = (await http.get("/kvmesh/workers")).json()["workers"]
        assert [w["lora_adapters"] for w in listed] == [["sql-lora"], ["sql-lora"]]
        # vLLM's own validation refuses a load without its path, on every engine: the client's 4xx
        r = await http.post("/v1/load_lora_adapter", json={"lora_name": "x"})
        assert r.status_code == 422, r.text
        r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "sql-lora"})
        assert r.status_code == 200, r.text
        listed = (await http.get("/kvmesh/workers")).json()["workers"]
        assert [w["lora_adapters"] for w in listed] == [[], []]
