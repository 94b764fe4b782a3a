"""Fake of ``tensorrt_llm/commands/serve.py``: the ``trtllm-serve`` click entry point, 1.2 shape.

Mirrors: ``main`` is a click group whose unknown first argument means the ``serve`` command
(TensorRT-LLM's ``DefaultGroup``); ``serve MODEL`` with ``--host``, ``--port``, ``--tokenizer``,
``--backend``, ``--max_num_tokens``, ``--tp_size`` and ``--config`` / ``--extra_llm_api_options``
(one option, two spellings: the YAML overrides the flags); ``launch_server`` binds the socket,
builds the LLM from the merged arguments, then ``OpenAIServer(generator=llm, model=...)`` and
``asyncio.run(server(host, port, sockets=[s]))``. ``OpenAIServer`` is imported by name, as
serve.py does (``from tensorrt_llm.serve import OpenAIServer``).

Test knobs (not TensorRT-LLM's): ``LLM_CLASS`` picks the LLM flavour, ``LAST`` records the last
launch (arguments, LLM, server).
"""

from __future__ import annotations

import asyncio
import socket

import click
import yaml

from tensorrt_llm.llmapi.llm import LLM
from tensorrt_llm.serve import OpenAIServer

LLM_CLASS = LLM
LLM_EXTRA: dict = {}
LAST: dict = {}


class DefaultGroup(click.Group):
    def resolve_command(self, ctx, args):
        if args and args[0] not in self.commands:
            args = ["serve", *args]
        return super().resolve_command(ctx, args)


def launch_server(host, port, llm_args):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    llm = LLM_CLASS(**llm_args, **LLM_EXTRA)
    kwargs = {OpenAIServer.FIRST_ARG: llm, "model": llm_args["model"]}
    server = OpenAIServer(**kwargs)
    LAST.update(llm=llm, server=server, llm_args=llm_args)
    asyncio.run(server(host, port, sockets=[s]))


@click.command("serve")
@click.argument("model")
@click.option("--host", default="localhost")
@click.option("--port", type=int, default=8000)
@click.option("--tokenizer", default=None)
@click.option("--backend", default="pytorch")
@click.option("--max_num_tokens", type=int, default=8192)
@click.option("--tensor_parallel_size", "--tp_size", type=int, default=1)
@click.option("--config", "--extra_llm_api_options", "extra_llm_api_options", default=None)
def serve(model, host, port, tokenizer, backend, max_num_tokens, tensor_parallel_size, extra_llm_api_options):
    llm_args = {
        "model": model,
        "max_num_tokens": max_num_tokens,
        "tensor_parallel_size": tensor_parallel_size,
    }
    if extra_llm_api_options is not None:
        with open(extra_llm_api_options) as f:
            llm_args.update(yaml.safe_load(f) or {})
    LAST["config_path"] = extra_llm_api_options
    launch_server(host, port, llm_args)


@click.command("disaggregated")
def disaggregated():
    raise SystemExit("not faked")


main = DefaultGroup(commands={"serve": serve, "disaggregated": disaggregated})
