#!/usr/bin/env bash
# kvmesh's standalone router in front of two *stock* trtllm-serve servers (no kvmesh launcher).
# trtllm-serve keeps its KV events in a queue that POST /kv_cache_events drains, which routers
# cannot share: `kvmesh events trtllm` beside each engine is that queue's one reader, and publishes
# the events on kvmesh's ZMQ wire for every router. Not run by kvmesh's authors (no TensorRT-LLM on
# their machines): the command was tested against a fake trtllm-serve.
set -euo pipefail
MODEL=${MODEL:-Qwen/Qwen2.5-7B-Instruct}

# On host 10.0.0.1 and 10.0.0.2 respectively (llm-options.yaml turns KV events on:
#   kv_cache_config: {tokens_per_block: 32, event_buffer_max_size: 1024, enable_block_reuse: true}):
#   trtllm-serve "$MODEL" --host 0.0.0.0 --port 8000 --config llm-options.yaml &
#   kvmesh events trtllm http://10.0.0.1:8000 --block-size 32 --advertise-host 10.0.0.1 &
# Each command prints the router's entry for its engine (the URL as given, and its sockets at the
# advertised host); router.toml holds the two.

here=$(cd "$(dirname "$0")" && pwd)
exec kvmesh router --config "$here/router.toml" --port 9000 --tokenizer "$MODEL"
