"""SGLang's Vertex AI prediction route read as the batch of ``/generate`` requests it amounts to.

Vertex AI sends a model container its predictions on one path, which it names to the container in
``AIP_PREDICT_ROUTE``; SGLang 0.5 serves that path (``/vertex_generate`` when the variable is not
set) with a body of ``instances`` (one object per prompt) and shared ``parameters``. It takes the
prompt's field from the first instance that has one of ``text``, ``input_ids`` or
``input_embeds`` (in that order, an empty value skipped), gives every instance's value of it as a
batch to its own ``/generate``, with the ``image_data`` of the instances that carry one, and the
parameters as the request's other fields (``sampling_params``, ``stream``, ``lora_path``...). A
whole answer comes back as ``{"predictions": [...]}`` (the batch's results); a stream, or an error,
as ``/generate`` sends it; no instances at all, as an empty list.

:func:`vertex_batch` turns the body into that ``/generate`` batch, and the router serves its
prompts one by one on ``/generate`` (:mod:`.batches`), each routed on its own prefix. What SGLang
would mix up or fail on is refused here, naming the field in the client's body (a 400 it can fix):
an instance without the first one's prompt field, ``image_data`` on some instances and not on
others (SGLang pairs the images with the first prompts), a parameter that is an instance's field.
A top-level ``nvext`` is read as on ``/generate`` (it is no field of SGLang's route).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvmesh.errors import RequestError
from kvmesh.router.request.batches import MAX_BATCH, PromptBatch, item_field, split_batch
from kvmesh.router.request.generate_api import GENERATE_PATH

VERTEX_PATH = "/vertex_generate"
"""The route's own name, the endpoint its requests are served as (whatever path it is on)."""
ROUTE_VARIABLE = "AIP_PREDICT_ROUTE"
_PROMPT_FIELDS = ("text", "input_ids", "input_embeds")
_INSTANCE_FIELDS = frozenset((*_PROMPT_FIELDS, "image_data"))


def vertex_route(environ: Mapping[str, str]) -> str:
    """The path the route is on: Vertex AI's ``AIP_PREDICT_ROUTE`` in the server's ``environ``
    when it names one, as SGLang reads it when its server starts, else ``/vertex_generate``."""
    route = environ.get(ROUTE_VARIABLE, "")
    return route if route.startswith("/") else VERTEX_PATH


def is_vertex(endpoint: str) -> bool:
    return endpoint == VERTEX_PATH


class VertexBatch(PromptBatch):
    """The ``/generate`` batch of a Vertex body: answered as ``{"predictions": [...]}``, its
    errors naming the instance (``instances[2].text``) or the parameter (``parameters`` names
    those the body gave) they are about."""

    def __init__(
        self, items: list[dict[str, Any]], samples: int, split: frozenset[str], parameters: frozenset[str]
    ) -> None:
        super().__init__(items, samples, split, GENERATE_PATH, unit="instance", answer_key="predictions")
        self.parameters = parameters

    def field(self, name: str | None, index: int) -> str | None:
        return _vertex_field(name, index, self.split, self.parameters)


def vertex_batch(body: dict[str, Any]) -> VertexBatch:
    """The batch of ``/generate`` requests a Vertex body amounts to (no items for no instances);
    a 400 naming the field for a body SGLang refuses or would serve wrongly."""
    instances = body.get("instances")
    if not isinstance(instances, list):
        raise RequestError("'instances' must be a list of objects, one per prompt", field="instances")
    if len(instances) > MAX_BATCH:
        raise RequestError(
            f"'instances': {len(instances)} of them; at most {MAX_BATCH} in one request", field="instances"
        )
    for i, instance in enumerate(instances):
        if not isinstance(instance, dict):
            raise RequestError(f"'instances[{i}]' must be an object", field=f"instances[{i}]")
    parameters = body.get("parameters")
    if parameters is None:
        parameters = {}
    elif not isinstance(parameters, dict):
        raise RequestError("'parameters' must be an object", field="parameters")
    if not instances:
        return VertexBatch([], 1, frozenset(), frozenset())
    for name in parameters:
        if name in _INSTANCE_FIELDS:
            raise RequestError(
                f"'parameters.{name}' is an instance's field: give it in each instance",
                field=f"parameters.{name}",
            )
    key = next((name for name in _PROMPT_FIELDS if instances[0].get(name)), None)
    if key is None:
        raise RequestError("'instances[0]' needs a prompt: 'text' or 'input_ids'", field="instances[0].text")
    if key == "input_embeds":
        raise RequestError(
            "'input_embeds': a prompt of embeddings is not routed (SGLang caches none of it); "
            "send it to an engine directly",
            field="instances[0].input_embeds",
        )
    prompts = []
    for i, instance in enumerate(instances):
        prompt = instance.get(key)
        if not prompt:
            raise RequestError(
                f"'instances[{i}].{key}' is missing: every instance gives its prompt as the first "
                f"one does ('{key}')",
                field=f"instances[{i}].{key}",
            )
        if key == "text" and not isinstance(prompt, str):
            raise RequestError(f"'instances[{i}].text' must be a string", field=f"instances[{i}].text")
        if key == "input_ids" and not (isinstance(prompt, list) and all(type(t) is int for t in prompt)):
            raise RequestError(
                f"'instances[{i}].input_ids' must be a list of token ids", field=f"instances[{i}].input_ids"
            )
        prompts.append(prompt)
    generate: dict[str, Any] = {**parameters, key: prompts}
    images = [instance.get("image_data") for instance in instances]
    given = [image is not None for image in images]
    if any(given):
        if not all(given):
            missing = given.index(False)
            raise RequestError(
                f"'instances[{missing}].image_data' is missing: give every instance an image, or "
                "none (SGLang pairs the images given with the first prompts)",
                field=f"instances[{missing}].image_data",
            )
        generate["image_data"] = images
    if "nvext" in body:
        generate["nvext"] = body["nvext"]
    try:
        batch = split_batch(generate, GENERATE_PATH)
    except RequestError as e:
        # (the prompts were checked above: what is left names a parameter, or nvext, whole)
        field = _vertex_field(e.field, 0, frozenset(), frozenset(parameters))
        raise RequestError(str(e), field=field, status=e.status) from None
    assert batch is not None  # (the prompts are a list)
    return VertexBatch(batch.items, batch.samples, batch.split, frozenset(parameters))


def _vertex_field(
    name: str | None, index: int, split: frozenset[str], parameters: frozenset[str]
) -> str | None:
    """Where a field of instance ``index``'s ``/generate`` request is in the Vertex body (a name
    that is no field of it, ``path`` or ``nvext.x``, is kept)."""
    if name is None:
        return None
    head = name.split(".", 1)[0].split("[", 1)[0]
    if head in _INSTANCE_FIELDS:
        return f"instances[{index}].{name}"
    if head in parameters:
        return "parameters." + (item_field(name, split, index) or name)
    return name


__all__ = ["ROUTE_VARIABLE", "VERTEX_PATH", "VertexBatch", "is_vertex", "vertex_batch", "vertex_route"]
