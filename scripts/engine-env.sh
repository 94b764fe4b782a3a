#!/usr/bin/env bash
# Build (once) and print the path of a Python environment holding a real inference engine's
# Python code on CPU, for kvmesh's engine-tier tests.
#
#   scripts/engine-env.sh vllm|sglang     -> prints the env's python path on stdout
#
# The environment lives outside the clone, under ${KVMESH_CACHE:-~/.cache/kvmesh}/envs/, keyed by
# a hash of the recipe below, so a fresh clone (or CI) reuses it instead of reinstalling gigabytes.
# The engine wheel is installed with --no-deps and its dependencies are listed by hand: letting pip
# resolve vLLM's own requirements pulls CUDA builds (torch, torchvision) that break every import.
set -euo pipefail

engine=${1:?usage: engine-env.sh vllm|sglang}
here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:-python3}

# Packages kvmesh itself and its engine tests need inside the engine environment. httptools is one
# of kvmesh's own requirements, so an engine with kvmesh installed is served by uvicorn's httptools
# protocol (which the middleware's direct relay writes to), whatever the engine itself requires.
kvmesh_deps="msgspec pyzmq xxhash prometheus-client aiohttp uvicorn httptools starlette httpx pytest pytest-timeout
  pytest-asyncio"

case "$engine" in
  vllm)
    engine_pkg="vllm==0.33.0"
    engine_deps="msgspec pyzmq torch==2.13.0 packaging psutil urllib3 regex numpy pydantic cbor2
      transformers>=5.16.1,<5.21 aiohttp requests openai-harmony openai pillow pybase64 cachetools
      cloudpickle uvloop py-cpuinfo prometheus_client xgrammar fastapi partial-json-parser
      llguidance einops prometheus-fastapi-instrumentator>=8.0.0 orjson>=3.11.6
      model-hosting-container-standards>=0.1.14,<1.0.0 python-multipart"
    ;;
  sglang)
    engine_pkg="sglang==0.5.23"
    # Enough of SGLang's declared requirements (its own pins where it has them) for the radix
    # caches, the scheduler and tokenizer-manager modules and the HTTP server to import on CPU.
    # Left out: CUDA kernels, and torchvision, whose registry wheels need CUDA torch; the tests
    # put a stand-in on the path instead (tests/engines/sglang_stubs, see sglang_env.py).
    engine_deps="torch==2.13.0 triton msgspec pyzmq pydantic numpy orjson psutil pybase64 requests
      packaging pillow starlette tqdm ipython aiohttp transformers==5.19.0 tokenizers==0.23.2
      compressed-tensors==0.18.0 apache-tvm-ffi==0.1.11 fastapi uvicorn>=0.51 uvloop setproctitle
      python-multipart partial_json_parser dill einops zstandard python-dateutil<3 distro easydict
      interegular blobfile==3.0.0 openai==2.8.0 anthropic sentencepiece==0.2.1 tiktoken gguf
      jsonschema xgrammar==0.2.7 soundfile==0.13.1 huggingface_hub scipy openai-harmony==0.0.4"
    ;;
  *) echo "engine-env.sh: unknown engine '$engine' (expected vllm or sglang)" >&2; exit 2 ;;
esac

recipe="$engine_pkg|$engine_deps|$kvmesh_deps|$($python -c 'import sys; print(sys.version_info[:2])')"
key=$(printf '%s' "$recipe" | sha256sum | cut -c1-12)
root=${KVMESH_CACHE:-$HOME/.cache/kvmesh}/envs
env="$root/$engine-$key"

if [ ! -f "$env/.complete" ]; then
  echo "engine-env: building $env (several GB, several minutes; reused afterwards)" >&2
  mkdir -p "$root"
  rm -rf "$env.partial"
  $python -m venv "$env.partial"
  pip="$env.partial/bin/python -m pip install --quiet --disable-pip-version-check"
  # shellcheck disable=SC2086
  $pip --no-deps "$engine_pkg" 2> >(grep -v "is ignored" >&2)
  # shellcheck disable=SC2086
  $pip $engine_deps $kvmesh_deps 2> >(grep -v "is ignored" >&2)
  # venv scripts carry absolute paths; the env is only ever used through its python binary.
  rm -rf "$env"
  mv "$env.partial" "$env"
  touch "$env/.complete"
fi
echo "$env/bin/python"
