"""kvmesh's router middleware embedded in SGLang 0.5.23's own HTTP app, driven over loopback HTTP.

The server (:mod:`tests.engines.sglang_middleware_server`, a child process: SGLang's app and the
mount are process globals) is SGLang's real FastAPI app, with kvmesh mounted by the launcher from
``KVMESH_*`` settings, SGLang's real chat route (its ``ChatCompletionRequest`` parses what reaches
the engine) and its real chat tokenization path over an in-memory Hugging Face tokenizer. The chat
serving's ``handle_request`` is a stand-in that answers with the body SGLang's route received.

The mesh has two workers that are the same server under two names (``127.0.0.1`` is this engine,
``localhost`` a peer reached over HTTP), so the router's choice between them is visible in
``nvext.worker_id`` while one SGLang process serves both. KV events are off (no scheduler runs
here): the router's approximate index learns from its own decisions. The direct relay's test
puts a raw streaming engine in the mesh as the peer instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.engines import sglang_env
from tests.events.eventkit import free_tcp_port
from tests.router.servers import StreamingEngine, pinned_stream_bytes, serve

pytestmark = [pytest.mark.engine_sglang, pytest.mark.timeout(300)]

BLOCK = 4


class Engine:
    def __init__(self, port: int, polarity: str) -> None:
        self.polarity = polarity
        self.url = f"http://127.0.0.1:{port}"
        self.peer = f"http://localhost:{port}"
        self.client = httpx.Client(base_url=self.url, timeout=60)

    def chat(self, text: str, **extra: Any) -> dict[str, Any]:
        nvext = extra.pop("nvext", {})
        nvext.setdefault("extra_fields", ["worker_id", "timing"])
        messages = extra.pop("messages", [{"role": "user", "content": text}])
        body = {"model": "dummy", "messages": messages, "nvext": nvext, **extra}
        response = self.client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        out: dict[str, Any] = response.json()
        out["seen"] = json.loads(out["choices"][0]["message"]["content"])
        return out


POLLS = 1800
"""Times the mesh's state is read, 0.1 s apart, while the server starts (SGLang's import takes a
while on a shared CPU)."""


def start_server(port: int, peer: str, control: str, *args: str) -> subprocess.Popen[bytes]:
    """:mod:`tests.engines.sglang_middleware_server` on ``port``, in a mesh with ``peer``, KV events
    off (no scheduler runs here)."""
    url = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "PYTHONPATH": str(sglang_env.REPO),
        "KVMESH_WORKERS": f"{url},{peer}",
        "KVMESH_SELF_URL": url,
        "KVMESH_ROUTER_KV_EVENTS": "false",
        "KVMESH_SGLANG_CONTROL": control,
    }
    return subprocess.Popen(
        [sys.executable, "-m", "tests.engines.sglang_middleware_server", str(port), *args],
        env=env,
        cwd=sglang_env.REPO,
    )


def both_up(child: subprocess.Popen[bytes], workers: Any) -> bool:
    """Whether ``/kvmesh/workers``'s answer shows both workers up (the server must be running)."""
    assert child.poll() is None, "the SGLang server exited"
    try:
        return [row["state"] for row in workers.json()["workers"]] == ["up", "up"]
    except (ValueError, KeyError):
        return False


@pytest.fixture(scope="module", params=["higher_first", "lower_first"])
def engine(request: pytest.FixtureRequest) -> Iterator[Engine]:
    flags = ["--schedule-low-priority-values-first"] if request.param == "lower_first" else []
    with running(request.param, *flags) as engine:
        yield engine


@contextlib.contextmanager
def running(polarity: str, *flags: str) -> Iterator[Engine]:
    """The server, once its mesh is up, with SGLang's own ``flags``."""
    sglang_env.prepare()
    port = free_tcp_port()
    args = [
        "--page-size",
        str(BLOCK),
        "--enable-priority-scheduling",
        "--kvmesh-events-port",
        str(free_tcp_port()),
        *flags,
    ]
    control = f"ipc:///tmp/kvmesh-sglang-mw-{os.getpid()}-{port}"
    child = start_server(port, f"http://localhost:{port}", control, *args)
    engine = Engine(port, polarity)
    try:
        for _ in range(POLLS):
            with contextlib.suppress(httpx.HTTPError):
                if both_up(child, engine.client.get("/kvmesh/workers")):
                    break
            time.sleep(0.1)
        else:
            raise AssertionError("the mesh did not come up")
        yield engine
    finally:
        engine.client.close()
        child.terminate()
        child.wait(timeout=30)


def test_the_body_sglang_receives_has_its_polarity_and_no_nvext(engine: Engine) -> None:
    info = engine.client.get("/kvmesh/info").json()
    assert info["priority_polarity"] == engine.polarity
    out = engine.chat("w1 w2 w3", nvext={"agent_hints": {"priority": 5}})
    expected = 5 if engine.polarity == "higher_first" else -5
    assert "nvext" not in out["seen"]["body"]
    assert out["seen"]["body"]["priority"] == expected
    assert out["seen"]["priority"] == expected  # as SGLang's ChatCompletionRequest parsed it
    # A client's own SGLang session_params pass through untouched (kvmesh never adds them).
    native = engine.chat("w4 w5", session_params={"id": "s-1", "rid": "r-0"})
    assert native["seen"]["body"]["session_params"] == {"id": "s-1", "rid": "r-0"}
    assert "session_params" not in out["seen"]["body"]


def test_a_warm_up_of_the_next_turn_reaches_sglangs_own_chat_route_in_process(engine: Engine) -> None:
    """``speculative_prefill`` sends the next turn's prompt to the engine that served the turn:
    here, this engine, in-process. SGLang's chat route finds its serving through ``request.app``,
    which that request lacked: the warm-up failed there."""
    before = engine.client.get("/test/speculative-prefills").json()
    engine.chat(
        "w7 w8 w9", nvext={"backend_instance_id": engine.url, "agent_hints": {"speculative_prefill": True}}
    )
    for _ in range(100):
        now = engine.client.get("/test/speculative-prefills").json()
        if now != before:
            break
        time.sleep(0.05)
    assert now == {**before, "done": before["done"] + 1}, (before, now)


def test_an_abort_reaches_sglangs_own_route_on_every_engine_of_the_mesh(engine: Engine) -> None:
    """This mesh is this server twice (its own address and a peer's name). An abort by ``rid``, and
    ``abort_all``, reach SGLang's real ``/abort_request`` route in-process and again through the
    peer: the engine to which the router moved a request stops it. Before, only the engine the
    client called heard of the abort. A rid that is not a string is refused, naming ``rid``."""
    seen = len(engine.client.get("/test/aborts").json())
    for body in ({"rid": "rollout-1"}, {"abort_all": True}):
        response = engine.client.post("/abort_request", json=body)
        assert response.status_code == 200, response.text
    for _ in range(100):
        aborted = engine.client.get("/test/aborts").json()[seen:]
        if len(aborted) >= 4:
            break
        time.sleep(0.05)
    assert sorted(aborted) == [["", True], ["", True], ["rollout-1", False], ["rollout-1", False]]
    refused = engine.client.post("/abort_request", json={"rid": 7})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "rid", refused.text


def test_under_sglangs_root_path_requests_are_routed_and_the_rpcs_answer() -> None:
    """SGLang's ``--fastapi-root-path /llm`` goes to uvicorn, which puts it before every path.
    Matched on the whole path, the middleware routed nothing (the engine got the nvext) and its
    admin API's ``/kvmesh/workers`` was a 404 (so this test's wait for the mesh timed out)."""
    with running("higher_first", "--fastapi-root-path", "/llm") as engine:  # (the mesh is up)
        assert engine.client.get("/kvmesh/info").json()["priority_polarity"] == "higher_first"
        out = engine.chat("w1 w2 w3", nvext={"agent_hints": {"priority": 5}})
        assert "nvext" not in out["seen"]["body"] and out["seen"]["body"]["priority"] == 5
        assert out["nvext"]["worker_id"]["decode_worker_id"] in (engine.url, engine.peer)


def test_router_hashes_with_sglangs_tokenizer_and_salted_or_lora_requests_get_no_credit(
    engine: Engine,
) -> None:
    for n, extra in enumerate(({"cache_salt": "tenant-a"}, {"lora_path": "my-adapter"})):
        text = " ".join(f"w{i}" for i in range(100 * n, 100 * n + 30))
        # SGLang's chat path renders "user : <30 words> assistant :": 34 ids of the word-level
        # tokenizer (kvmesh's builtin fallback would render and count it differently).
        tokens = 34
        first = engine.chat(text, nvext={"backend_instance_id": engine.url})
        assert first["nvext"]["worker_id"]["decode_worker_id"] == engine.url
        again = engine.chat(text)
        # Credited with the prefix it routed before, hashed from SGLang's token ids (8 full blocks).
        assert again["nvext"]["worker_id"]["decode_worker_id"] == engine.url
        assert again["nvext"]["timing"]["cached_tokens_predicted"] == tokens // BLOCK * BLOCK
        namespaced = engine.chat(text, **extra)
        # SGLang caches it apart: no credit for the unsalted, base-model prefix, so the router
        # picks the worker whose cache it would not disturb (the peer's tree is the smaller).
        assert namespaced["nvext"]["worker_id"]["decode_worker_id"] == engine.peer, extra
        assert namespaced["nvext"]["timing"]["cached_tokens_predicted"] == 0
        assert "nvext" not in namespaced["seen"]["body"]
        for field, value in extra.items():
            assert namespaced["seen"]["body"][field] == value


def test_a_continued_final_message_is_hashed_as_sglang_renders_it(engine: Engine) -> None:
    """``continue_final_message``: SGLang takes the last assistant message out, renders the rest
    with its generation prompt and adds the message's own ids, "user : <30> assistant : <8>", 42
    ids (10 full blocks). The router hashes those ids through SGLang's tokenize path. Without the
    flag, SGLang reads a last assistant message as the user's: "user : <30> user : <8>
    assistant :", 44 ids (11 blocks)."""
    question = " ".join(f"w{i}" for i in range(200, 230))
    start = " ".join(f"w{i}" for i in range(230, 238))
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": start}]
    fields = {"messages": messages, "continue_final_message": True}
    engine.chat("", nvext={"backend_instance_id": engine.url}, **fields)
    again = engine.chat("", **fields)
    assert again["nvext"]["worker_id"]["decode_worker_id"] == engine.url
    assert again["nvext"]["timing"]["cached_tokens_predicted"] == 42 // BLOCK * BLOCK
    assert again["seen"]["body"]["continue_final_message"] is True


def test_a_responses_body_is_hashed_as_sglangs_responses_serving_renders_it(engine: Engine) -> None:
    """SGLang turns a Responses body into chat its own way (a developer message becomes labelled
    system text, coalesced with the instructions; ``input_text`` parts become text parts), then
    renders it with its chat path. The test server's Responses serving is SGLang's own, answering
    with the ids its ``_make_request`` rendered; the router must have hashed the same prompt."""

    def words(lo: int, hi: int) -> str:
        return " ".join(f"w{i}" for i in range(lo, hi))

    body = {
        "model": "dummy",
        "instructions": words(300, 310),
        "input": [
            {"role": "developer", "content": words(310, 316)},
            {"role": "user", "content": [{"type": "input_text", "text": words(316, 340)}]},
        ],
    }
    answers = []
    for nvext in ({"backend_instance_id": engine.url}, {}):
        nvext["extra_fields"] = ["worker_id", "timing"]
        response = engine.client.post("/v1/responses", json={**body, "nvext": nvext})
        assert response.status_code == 200, response.text
        answers.append(response.json())
    again = answers[1]
    rendered = len(again["seen"]["ids"])
    assert again["nvext"]["worker_id"]["decode_worker_id"] == engine.url
    assert again["nvext"]["timing"]["cached_tokens_predicted"] == rendered // BLOCK * BLOCK
    # A body SGLang's own request model refuses is the client's 400, naming the field.
    refused = engine.client.post("/v1/responses", json={**body, "temperature": "hot"})
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "temperature"


def test_an_anthropic_messages_body_is_hashed_as_sglangs_messages_serving_renders_it(
    engine: Engine,
) -> None:
    """SGLang converts ``/v1/messages`` into a chat request its own way, then tokenizes it with its
    chat path; the test server's Messages serving is SGLang's own, answering with those ids. The
    router must have hashed the same prompt: a repeat is credited with every whole page of it."""

    def words(lo: int, hi: int) -> str:
        return " ".join(f"w{i}" for i in range(lo, hi))

    body = {
        "model": "dummy",
        "max_tokens": 8,
        # (SGLang joins system blocks with a newline, vLLM with nothing: SGLang's own way counts)
        "system": [{"type": "text", "text": words(300, 306)}, {"type": "text", "text": words(306, 312)}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": words(312, 330)}]},
            {"role": "assistant", "content": words(330, 336)},
            {"role": "user", "content": words(336, 350)},
        ],
    }
    answers = []
    for nvext in ({"backend_instance_id": engine.url}, {}):
        nvext["extra_fields"] = ["worker_id", "timing"]
        response = engine.client.post("/v1/messages", json={**body, "nvext": nvext})
        assert response.status_code == 200, response.text
        answers.append(response.json())
    again = answers[1]
    ids = json.loads(again["content"][0]["text"])["ids"]
    assert len(ids) > 40
    assert again["nvext"]["worker_id"]["decode_worker_id"] == engine.url
    assert again["nvext"]["timing"]["cached_tokens_predicted"] == len(ids) // BLOCK * BLOCK
    refused = engine.client.post("/v1/messages", json={**body, "max_tokens": 0})
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "max_tokens"


def test_sglangs_generate_is_routed_on_the_ids_sglang_tokenizes_its_text_to(engine: Engine) -> None:
    """SGLang's native ``/generate`` (its real route and request parsing; the test server's
    ``generate_request`` tokenizes with the real TokenizerManager's text tokenization and answers
    with the ids). The router must have hashed those ids: a repeat is credited with every whole
    page of them. The priority arrives in SGLang's polarity, nvext's sampling inside
    ``sampling_params``, and a session's request is served here, untouched."""
    text = " ".join(f"w{i}" for i in range(200, 241))
    answers = []
    for nvext in ({"backend_instance_id": engine.url}, {}):
        nvext |= {"extra_fields": ["worker_id", "timing"], "agent_hints": {"priority": 5}, "ignore_eos": True}
        body = {"text": text, "sampling_params": {"max_new_tokens": 4}, "nvext": nvext}
        response = engine.client.post("/generate", json=body)
        assert response.status_code == 200, response.text
        answers.append(response.json())
    again = answers[1]
    ids = again["seen"]["ids"]
    assert ids == [5 + i for i in range(200, 241)]  # (the test vocabulary's w0 is id 5)
    assert again["nvext"]["worker_id"]["decode_worker_id"] == engine.url
    assert again["nvext"]["timing"]["cached_tokens_predicted"] == len(ids) // BLOCK * BLOCK
    assert again["seen"]["priority"] == (5 if engine.polarity == "higher_first" else -5)
    assert again["seen"]["sampling_params"] == {"max_new_tokens": 4, "ignore_eos": True}
    # A batch: each prompt reaches SGLang's route on its own, with the rid and the sampling
    # parameters SGLang's own batch would give it; the answers come back as SGLang lists them.
    short = "w7 w8 w9"
    params = [{"max_new_tokens": 3}, {"max_new_tokens": 2}]
    batch = engine.client.post(
        "/generate", json={"text": [text, short], "rid": "b", "sampling_params": params}
    )
    assert batch.status_code == 200, batch.text
    assert [a["meta_info"]["id"] for a in batch.json()] == ["b_0", "b_1"]
    assert [a["seen"]["ids"] for a in batch.json()] == [ids, [12, 13, 14]]
    assert [a["seen"]["sampling_params"] for a in batch.json()] == params
    wrong = engine.client.post("/generate", json={"text": [text, short], "sampling_params": params[:1]})
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "sampling_params"
    # A session's turn is the engine's own.
    session = engine.client.post("/generate", json={"input_ids": [7, 8], "session_params": {"id": "s-9"}})
    assert session.status_code == 200, session.text
    assert session.json()["seen"]["ids"] == [7, 8] and "nvext" not in session.json()
    echo = {"input_ids": [7, 8], "session_params": {"id": "s-9"}, "nvext": {"extra_fields": ["worker_id"]}}
    refused = engine.client.post("/generate", json=echo)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "nvext.extra_fields"


def test_ollamas_chat_and_generate_are_routed_on_the_prompt_sglang_renders(engine: Engine) -> None:
    """SGLang's own Ollama serving renders ``/api/chat``'s messages (their roles and contents: an
    image is dropped) with the template and its generation prompt, and ``/api/generate``'s system
    text and prompt as one text; its answer counts the prompt it rendered. The router must read
    the same prompt: a repeat goes where the first went, matched on every whole page of SGLang's
    count, and the router's own count of it (matched plus still to prefill) is SGLang's. The model
    named is of Ollama's kind ("llama3:8b"), which SGLang does not read: its ":" names no adapter."""

    def words(lo: int, hi: int) -> str:
        return " ".join(f"w{i}" for i in range(lo, hi))

    bodies = {
        "/api/chat": {
            "model": "llama3:8b",
            "stream": False,
            "messages": [
                {"role": "system", "content": words(0, 12)},
                {"role": "user", "content": words(12, 41), "images": ["AAAA"]},
            ],
        },
        "/api/generate": {
            "model": "llama3:8b",
            "stream": False,
            "system": words(50, 60),
            "prompt": words(60, 91),
        },
    }
    for path, body in bodies.items():
        first = engine.client.post(path, json={**body, "nvext": {"backend_instance_id": engine.url}})
        assert first.status_code == 200, first.text
        again = engine.client.post(path, json=body)
        assert again.status_code == 200, again.text
        assert again.headers["x-kvmesh-worker-id"] == engine.url
        rendered = again.json()["prompt_eval_count"]
        assert rendered > 40
        (decision,) = engine.client.get("/kvmesh/decisions?limit=1").json()["decisions"]
        (chosen,) = (c for c in decision["candidates"] if c["chosen"])
        assert decision["overlap_blocks"] == rendered // BLOCK, path
        assert chosen["overlap_blocks"] * BLOCK + chosen["prefill_tokens"] == rendered, path
    # Streamed (Ollama's default): SGLang's newline-delimited lines come back as they went.
    streamed = engine.client.post("/api/chat", json={**bodies["/api/chat"], "stream": True})
    assert streamed.status_code == 200
    assert streamed.headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(line) for line in streamed.text.splitlines()]
    assert [line["message"]["content"] for line in lines] == ["w1"]
    # What the router would write in OpenAI's names is refused: Ollama's body has no place for it.
    refused = engine.client.post("/api/generate", json={**bodies["/api/generate"], "nvext": {"top_k": 3}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "nvext.top_k"


def test_vertex_ai_instances_are_routed_one_by_one_as_sglang_reads_them(engine: Engine) -> None:
    """SGLang's Vertex AI route turns its instances into one ``/generate`` batch. kvmesh routes
    each instance on its own prefix and serves it on SGLang's real ``/generate``: what reaches the
    engine for instance i (its ids as SGLang tokenizes them, its sampling parameters, its rid) is
    what SGLang's own route hands the engine for prompt i of its batch. A repeat of an instance goes
    where the first went, matched on every whole page of it."""

    def words(lo: int, hi: int) -> str:
        return " ".join(f"w{i}" for i in range(lo, hi))

    body = {
        "instances": [{"text": words(0, 30)}, {"text": words(100, 153)}],
        "parameters": {"sampling_params": {"max_new_tokens": 4, "temperature": 0.5}, "rid": "v"},
    }
    own = engine.client.post("/test/sglang-vertex", json=body)
    assert own.status_code == 200, own.text
    batch = own.json()["predictions"]  # (the stand-in engine answers a batch in one result)
    routed = engine.client.post("/vertex_generate", json=body)
    assert routed.status_code == 200, routed.text
    predictions = routed.json()["predictions"]
    assert len(predictions) == 2
    for i, prediction in enumerate(predictions):
        assert prediction["seen"]["ids"] == batch["seen"]["ids"][i]
        assert prediction["seen"]["sampling_params"] == batch["seen"]["sampling_params"][i]
        assert prediction["meta_info"]["id"] == batch["meta_info"]["id"][i] == f"v_{i}"
    # A repeat of an instance goes where it went, matched on its whole pages.
    one: dict[str, Any] = {
        "instances": [{"text": words(200, 241)}],
        "nvext": {"backend_instance_id": engine.peer},
    }
    assert engine.client.post("/vertex_generate", json=one).status_code == 200
    del one["nvext"]
    again = engine.client.post("/vertex_generate", json=one)
    assert again.status_code == 200, again.text
    assert again.headers["x-kvmesh-worker-id"] == engine.peer
    length = len(again.json()["predictions"][0]["seen"]["ids"])
    assert length > 40
    (decision,) = engine.client.get("/kvmesh/decisions?limit=1").json()["decisions"]
    assert decision["overlap_blocks"] == length // BLOCK
    # What SGLang would pair wrongly is refused, naming the instance.
    mixed = {"instances": [{"text": "w1", "image_data": "AAAA"}, {"text": "w2"}]}
    refused = engine.client.post("/vertex_generate", json=mixed)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "instances[1].image_data"


@pytest.mark.parametrize("api_key", [None, "sk-test"])
async def test_a_peers_streamed_answer_is_relayed_from_the_socket_callback_inside_sglang(
    tmp_path: Path, api_key: str | None
) -> None:
    """SGLang's app served by uvicorn on httptools (kvmesh requires it): kvmesh's middleware sits
    right inside Starlette's outermost layer there, so a peer's tokens go to the client from the
    worker connection's callback (``direct_relay``), byte for byte. With ``--api-key`` SGLang's
    launch adds its own pure-ASGI key check outside kvmesh's layer; it hands on uvicorn's ``send``
    as it got it, so the relay stays direct."""
    peer = StreamingEngine(events=24)
    port = free_tcp_port()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with serve(peer) as upstream:
        argv = ["--page-size", str(BLOCK), "--kvmesh-events-port", str(free_tcp_port())]
        if api_key:
            argv += ["--api-key", api_key]
        child = start_server(port, upstream.url, f"ipc://{tmp_path}/control", *argv)
        try:
            async with httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{port}", timeout=60, headers=headers
            ) as http:
                for _ in range(POLLS):
                    with contextlib.suppress(httpx.HTTPError):
                        if both_up(child, await http.get("/kvmesh/workers")):
                            break
                    await asyncio.sleep(0.1)
                else:
                    raise AssertionError("the mesh did not come up")
                before = (await http.get("/test/relayed-chunks")).json()
                received = await pinned_stream_bytes(http, upstream.url, "dummy")
                after = (await http.get("/test/relayed-chunks")).json()
                if api_key:  # the key is checked before kvmesh routes anything
                    denied = await http.post(
                        "/v1/chat/completions",
                        json={"model": "dummy"},
                        headers={"Authorization": "Bearer no"},
                    )
                    assert denied.status_code == 401
        finally:
            child.terminate()
            await asyncio.to_thread(child.wait, 30)
    assert received == peer.sent
    assert after["direct"] - before["direct"] >= 12
