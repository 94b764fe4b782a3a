#!/usr/bin/env bash
# A 2-engine kvmesh mesh on one machine: two `vllm serve` processes, each with kvmesh's plugin
# (KV-event publisher, /kvmesh/* RPCs) and kvmesh's router embedded as middleware. A client may
# send to either engine; each routes every request to the engine that holds the longest cached
# prefix (weighed against load) and serves or forwards it.
#
#   pip install 'kvmesh[vllm]'            # in the vLLM environment (vLLM 0.33.0)
#   examples/vllm/mesh.sh [MODEL]         # Ctrl-C stops both engines
#
# Needs GPUs: engine A on GPU 0, engine B on GPU 1 (set GPU_A=0 GPU_B=0 and a lower
# GPU_MEMORY_UTILIZATION to share one GPU).
set -euo pipefail

MODEL=${1:-Qwen/Qwen2.5-0.5B-Instruct}
HOST=${HOST:-127.0.0.1}            # the address peers reach each engine at
GPU_A=${GPU_A:-0}
GPU_B=${GPU_B:-1}
GPU_MEMORY_UTILIZATION=${GPU_MEMORY_UTILIZATION:-0.85}

# The whole fleet, the same list on every engine; KVMESH_SELF_URL says which one is "me".
export KVMESH_WORKERS="http://$HOST:8001,http://$HOST:8002"
export VLLM_PLUGINS=kvmesh             # loads both kvmesh entry points (publisher + /kvmesh routes)
# export KVMESH_ADMIN_TOKEN=...        # guard /kvmesh/* with a shared token (same on every engine)
# export KVMESH_PIN_BUDGET=0.25        # share of the KV cache pins and sessions may hold

serve() {  # serve PORT GPU EVENTS_PORT
  local port=$1 gpu=$2 events=$3
  CUDA_VISIBLE_DEVICES=$gpu KVMESH_SELF_URL="http://$HOST:$port" \
  vllm serve "$MODEL" \
    --host "$HOST" --port "$port" \
    --gpu-memory-utilization "$GPU_MEMORY_UTILIZATION" \
    --scheduling-policy priority \
    --kv-events-config "{\"enable_kv_cache_events\": true, \"publisher\": \"kvmesh\",
                         \"endpoint\": \"tcp://*:$events\", \"replay_endpoint\": \"tcp://*:$((events + 1))\"}" \
    --middleware kvmesh.adapters.vllm.KvMeshMiddleware &
}

trap 'kill $(jobs -p) 2>/dev/null; wait' EXIT INT TERM
serve 8001 "$GPU_A" 5557
serve 8002 "$GPU_B" 5567
wait
