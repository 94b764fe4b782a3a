"""A request that carries a batch of prompts, cut into one request per prompt.

vLLM and SGLang both take several prompts in one body: ``/v1/completions`` with a ``prompt`` that
is a list of texts or of token-id lists (evaluation harnesses send their prompts so), and SGLang's
``/generate`` with ``text`` (or ``input_ids``) as a list, which RL rollouts and offline jobs send.
Each prompt has a prefix of its own, so each is routed on its own: :func:`split_batch` gives the
body of one request per prompt, in order, and the router serves them as it serves any request,
then answers with one response in the engine's batch shape (:mod:`kvmesh.router.asgi.batches`).

vLLM 0.33 also has ``/v1/chat/completions/batch``: ``messages`` is a list of conversations, and
each is a chat request of its own (served on ``/v1/chat/completions``). vLLM answers it whole, one
choice per conversation, never streamed; a ``stream`` asked for is a 400 naming it here.

An answer's samples are numbered as the engines number them: prompt ``i``'s sample ``j`` is
``i * samples + j``. Per-prompt fields follow SGLang's ``GenerateReqInput`` (a list gives one
value per prompt, anything else is every prompt's); a list of the wrong length is a 400 naming
it, as the engine refuses it.
"""

from __future__ import annotations

from typing import Any

from kvmesh.errors import RequestError

MAX_BATCH = 1024
"""Most prompts one request may carry: each becomes a request of its own on the router."""

COMPLETIONS_PATH = "/v1/completions"
CHAT_BATCH_PATH = "/v1/chat/completions/batch"
CHAT_PATH = "/v1/chat/completions"

# /generate fields whose list gives one value per prompt (SGLang's GenerateReqInput).
_PER_PROMPT = (
    "rid",
    "sampling_params",
    "image_data",
    "video_data",
    "audio_data",
    "mm_hashes",
    "mm_content_hashes",
    "watermark",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_sampling_mask",
    "sampling_logprobs_mode",
    "return_hidden_states",
    "lora_path",
    "lora_id",
    "custom_logit_processor",
    "extra_key",
    "cache_salt",
    "kv_hints",
    "positional_embed_overrides",
    "decode_tp_size",
)
# /generate fields that are a list for one prompt already: a list of lists gives one per prompt.
_PER_PROMPT_NESTED = ("token_ids_logprob", "multi_item_delimiter_indices", "token_indices_to_pool")


class PromptBatch(Exception):
    """The body is a batch of prompts, not one request: ``items`` are the bodies of one request
    per prompt, in order; each asks for ``samples`` answers. ``split`` names the fields that were
    cut by prompt (an error about one of them in prompt ``i`` is about ``field[i]``). Each item is
    served on ``item_path`` (None: the batch's own path). An answer whole is the batch's results
    (``answer_key``: under that key of an object); what its errors name is :meth:`field`'s."""

    def __init__(
        self,
        items: list[dict[str, Any]],
        samples: int,
        split: frozenset[str],
        item_path: str | None = None,
        *,
        unit: str = "prompt",
        answer_key: str | None = None,
    ) -> None:
        super().__init__(f"a batch of {len(items)} prompts")
        self.items = items
        self.samples = samples
        self.split = split
        self.item_path = item_path
        self.unit = unit
        """What one item is called in the batch's errors."""
        self.answer_key = answer_key

    def field(self, name: str | None, index: int) -> str | None:
        """Where a field of item ``index``'s request is in the batch's body (:func:`item_field`)."""
        return item_field(name, self.split, index)


def split_batch(body: dict[str, Any], endpoint: str) -> PromptBatch | None:
    """The batch this body carries, or None for a body of one prompt (which includes a
    completions batch of one: the engines answer it as a single prompt). A chat batch is always
    one, whatever its size: its answer has the batch's shape."""
    if endpoint == CHAT_BATCH_PATH:
        batch: PromptBatch | None = _chat_batch(body)
    elif endpoint == COMPLETIONS_PATH:
        batch = _completions_batch(body)
    else:
        batch = _generate_batch(body)
    if batch is not None:
        _refuse_nvext(body, endpoint)
    return batch


def _refuse_nvext(body: dict[str, Any], endpoint: str) -> None:
    """What one request does once, and a batch's prompts would each do (400 naming the field):
    open or close one session, stream the prompt's tokens ahead of the answer, or (in one merged
    completion) echo the worker that served it."""
    nvext = body.get("nvext")
    if not isinstance(nvext, dict):
        return  # (the prompts' own checks name what is wrong with it)
    names = ("session_control", "annotations", "extra_fields")
    for name in names if endpoint in (COMPLETIONS_PATH, CHAT_BATCH_PATH) else names[:2]:
        if nvext.get(name) is not None:
            raise RequestError(
                f"nvext.{name} applies to one prompt; a batch's prompts are routed one by one: "
                "send them as separate requests",
                field=f"nvext.{name}",
            )


def _completions_batch(body: dict[str, Any]) -> PromptBatch | None:
    prompts = body.get("prompt")
    if not (isinstance(prompts, list) and len(prompts) > 1):
        return None
    if all(type(p) is int for p in prompts):
        return None  # (one prompt of token ids)
    _check_size(len(prompts), "prompt")
    for i, prompt in enumerate(prompts):
        if not (
            isinstance(prompt, str) or (isinstance(prompt, list) and all(type(t) is int for t in prompt))
        ):
            raise RequestError(f"'prompt[{i}]' must be a string or a list of token ids", field=f"prompt[{i}]")
    n = body.get("n", 1)
    samples = n if type(n) is int and n > 0 else 1
    items = [{**body, "prompt": prompt} for prompt in prompts]
    return PromptBatch(items, samples, frozenset(("prompt",)))


def _chat_batch(body: dict[str, Any]) -> PromptBatch:
    conversations = body.get("messages")
    if not (isinstance(conversations, list) and conversations):
        raise RequestError(
            "'messages' must be a non-empty list of conversations, each a list of messages",
            field="messages",
        )
    _check_size(len(conversations), "messages")
    for i, conversation in enumerate(conversations):
        if not (isinstance(conversation, list) and conversation):
            raise RequestError(
                f"'messages[{i}]' must be a conversation: a non-empty list of messages",
                field=f"messages[{i}]",
            )
    if body.get("stream") not in (None, False):
        raise RequestError(
            "a chat batch is answered whole: 'stream' must be false or left out", field="stream"
        )
    n = body.get("n", 1)
    samples = n if type(n) is int and n > 0 else 1
    items = [{**body, "messages": conversation} for conversation in conversations]
    return PromptBatch(items, samples, frozenset(("messages",)), item_path=CHAT_PATH)


def _generate_batch(body: dict[str, Any]) -> PromptBatch | None:
    text = body.get("text")
    ids = body.get("input_ids")
    if text is not None:  # (SGLang reads text before input_ids)
        if not isinstance(text, list):
            return None
        key, prompts = "text", text
    elif isinstance(ids, list) and ids and isinstance(ids[0], list):
        key, prompts = "input_ids", ids
    else:
        return None
    if not prompts:
        raise RequestError(f"'{key}' must not be an empty list", field=key)
    size = len(prompts)
    _check_size(size, key)
    for i, prompt in enumerate(prompts):  # (one prompt each: a batch is never inside a batch)
        if key == "text" and not isinstance(prompt, str):
            raise RequestError(f"'text[{i}]' must be a string", field=f"text[{i}]")
        if key == "input_ids" and not (isinstance(prompt, list) and all(type(t) is int for t in prompt)):
            raise RequestError(f"'input_ids[{i}]' must be a list of token ids", field=f"input_ids[{i}]")
    split = {key}
    per_prompt: dict[str, list[Any]] = {}
    for name in _PER_PROMPT:
        value = body.get(name)
        if isinstance(value, list) and not (name == "image_data" and not value):
            per_prompt[name] = _checked(value, name, size)
    for name in _PER_PROMPT_NESTED:
        value = body.get(name)
        if isinstance(value, list) and value and isinstance(value[0], list):
            per_prompt[name] = _checked(value, name, size)
    split.update(per_prompt)
    rid = body.get("rid")
    samples = _generate_samples(body.get("sampling_params"))
    common = {k: v for k, v in body.items() if k not in split and not (k == "image_data" and v == [])}
    items = []
    for i, prompt in enumerate(prompts):
        item = dict(common)
        item[key] = prompt
        for name, values in per_prompt.items():
            item[name] = values[i]
        if isinstance(rid, str):  # SGLang's own numbering of a batch's rids
            item["rid"] = f"{rid}_{i}"
        items.append(item)
    if isinstance(rid, str):
        split.add("rid")
    return PromptBatch(items, samples, frozenset(split))


def _generate_samples(params: Any) -> int:
    """How many answers each prompt gets, as SGLang counts them: ``n`` (the same in every
    prompt's parameters), or one for beam search, whose ``n`` is the beams it returns."""
    listed = params if isinstance(params, list) else [params]
    counts = {_samples_of(p) for p in listed}
    if len(counts) > 1:
        raise RequestError(
            "'sampling_params': every prompt of a batch must ask for the same 'n'",
            field="sampling_params",
        )
    return counts.pop() if counts else 1


def _samples_of(params: Any) -> int:
    if not isinstance(params, dict):
        return 1
    beams = params.get("beam_width")
    if type(beams) is int and beams > 1:
        return 1
    n = params.get("n", 1)
    return n if type(n) is int and n > 0 else 1


def _checked(values: list[Any], name: str, size: int) -> list[Any]:
    if len(values) != size:
        raise RequestError(f"'{name}' has {len(values)} entries for a batch of {size} prompts", field=name)
    return values


def _check_size(size: int, key: str) -> None:
    if size > MAX_BATCH:
        raise RequestError(
            f"'{key}': a batch of {size} prompts; at most {MAX_BATCH} in one request", field=key
        )


def item_field(field: str | None, split: frozenset[str], index: int) -> str | None:
    """The field a prompt's error names, in the batch's body: ``text`` of prompt 2 is
    ``text[2]``, ``sampling_params.n`` of a list of parameters ``sampling_params[2].n``."""
    if field is None:
        return None
    cut = len(field)
    for mark in (".", "["):
        at = field.find(mark)
        if 0 <= at < cut:
            cut = at
    head = field[:cut]
    return f"{head}[{index}]{field[cut:]}" if head in split else field


__all__ = ["CHAT_BATCH_PATH", "COMPLETIONS_PATH", "MAX_BATCH", "PromptBatch", "item_field", "split_batch"]
