#!/usr/bin/env bash
# kvmesh's standalone router in front of two *stock* SGLang servers (no kvmesh inside them).
# Stock SGLang has no /kvmesh/info, so router.toml describes each worker: its KV-event endpoints
# (SGLang's own zmq publisher, one stream per DP rank), its page size and its priority polarity.
set -euo pipefail
MODEL=${MODEL:-Qwen/Qwen2.5-7B-Instruct}

# On host 10.0.0.1 and 10.0.0.2 respectively:
#   python -m sglang.launch_server --model-path "$MODEL" --host 0.0.0.0 --port 30000 --page-size 16 \
#     --enable-priority-scheduling --enable-cache-report \
#     --kv-events-config '{"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'

here=$(cd "$(dirname "$0")" && pwd)
exec kvmesh router --config "$here/router.toml" --port 8000 --tokenizer "$MODEL"
