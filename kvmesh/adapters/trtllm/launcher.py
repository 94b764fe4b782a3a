"""``python -m kvmesh.adapters.trtllm <trtllm-serve arguments>``: trtllm-serve with kvmesh inside.

1. :func:`.argv.prepare` strips kvmesh's flags and turns KV events on in the LLM-API YAML;
2. :func:`.server.install` patches trtllm-serve's ``OpenAIServer`` so the server it builds carries
   kvmesh's router, worker RPCs and event bridge;
3. trtllm-serve's own click entry point (``tensorrt_llm.commands.serve:main``, what the
   ``trtllm-serve`` script runs) gets the rewritten arguments, in this process.
"""

from __future__ import annotations

import logging
import os
import sys

from kvmesh.adapters.trtllm._trtllm import import_trtllm
from kvmesh.adapters.trtllm.argv import prepare
from kvmesh.adapters.trtllm.server import install
from kvmesh.errors import ConfigError, EngineMissing

logger = logging.getLogger("kvmesh.adapters.trtllm")


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        launch = prepare(args)
    except ConfigError as e:
        print(f"kvmesh: {e}", file=sys.stderr)
        return 2
    os.environ.update(launch.env)
    try:
        try:
            serve = import_trtllm("tensorrt_llm.commands.serve")
        except EngineMissing as e:  # (a traceback before; TensorRT-LLM's own import errors show theirs)
            print(f"kvmesh: {e}", file=sys.stderr)
            return 1
        install(launch.options)
        logger.info("kvmesh: starting trtllm-serve %s", " ".join(launch.argv))
        try:
            serve.main(args=launch.argv, prog_name="trtllm-serve", standalone_mode=False)
        except SystemExit as e:  # click's own exit (--help, a usage error): keep its code
            return int(e.code or 0) if not isinstance(e.code, str) else 1
        return 0
    finally:
        if launch.config_path is not None:
            os.unlink(launch.config_path)
