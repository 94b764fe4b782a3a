#!/usr/bin/env bash
# kvmesh's standalone router in front of two *stock* vLLM servers (kvmesh not installed in the
# vLLM environment). The engines only publish their KV events with vLLM's own zmq publisher; the
# router reads them, so the workers are described in router.toml (stock vLLM has no /kvmesh/info).
#
#   examples/vllm/standalone_router.sh MODEL_DIR   # a local model directory (the router tokenizes
#                                                  # with its tokenizer and chat template)
#
# Needs GPUs (see mesh.sh for GPU_A / GPU_B / GPU_MEMORY_UTILIZATION). Clients talk to :8000.
set -euo pipefail

MODEL_DIR=${1:?usage: standalone_router.sh MODEL_DIR}
HERE=$(cd "$(dirname "$0")" && pwd)
GPU_A=${GPU_A:-0}
GPU_B=${GPU_B:-1}
GPU_MEMORY_UTILIZATION=${GPU_MEMORY_UTILIZATION:-0.85}

stock_vllm() {  # stock_vllm PORT GPU EVENTS_PORT
  local port=$1 gpu=$2 events=$3
  CUDA_VISIBLE_DEVICES=$gpu vllm serve "$MODEL_DIR" \
    --host 127.0.0.1 --port "$port" \
    --gpu-memory-utilization "$GPU_MEMORY_UTILIZATION" \
    --scheduling-policy priority \
    --num-gpu-blocks-override 20000 \
    --kv-events-config "{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\",
                         \"endpoint\": \"tcp://*:$events\", \"replay_endpoint\": \"tcp://*:$((events + 1))\"}" &
}

trap 'kill $(jobs -p) 2>/dev/null; wait' EXIT INT TERM
stock_vllm 8001 "$GPU_A" 5557
stock_vllm 8002 "$GPU_B" 5567

# router.toml pins each worker's block size, event endpoints and cache size; --tokenizer must be
# the served model's tokenizer so the router's block hashes match what vLLM caches.
kvmesh router --host 127.0.0.1 --port 8000 --config "$HERE/router.toml" --tokenizer "$MODEL_DIR" &
wait
