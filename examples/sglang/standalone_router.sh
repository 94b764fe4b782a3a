#!/usr/bin/env bash
# kvmesh's standalone router in front of two *stock* SGLang servers (no kvmesh inside them).
# Stock SGLang has no /kvmesh/info; the router reads each worker from the kv_events description
# of its /server_info (SGLang's own zmq publisher, one stream per DP rank on port + rank), its
# page size, DP size and priority order. router.toml describes the same workers by hand, for a
# router that should not depend on it (use --config "$here/router.toml" instead of --workers).
set -euo pipefail
MODEL=${MODEL:-Qwen/Qwen2.5-7B-Instruct}

# On host 10.0.0.1 and 10.0.0.2 respectively:
#   python -m sglang.launch_server --model-path "$MODEL" --host 0.0.0.0 --port 30000 --page-size 16 \
#     --enable-priority-scheduling --enable-cache-report \
#     --kv-events-config '{"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'

here=$(cd "$(dirname "$0")" && pwd)
exec kvmesh router --workers http://10.0.0.1:30000,http://10.0.0.2:30000 --port 8000 --tokenizer "$MODEL"
