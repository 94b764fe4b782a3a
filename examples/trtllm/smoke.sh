#!/usr/bin/env bash
# GPU smoke test for kvmesh inside trtllm-serve (TensorRT-LLM): two engines with a small model,
# kvmesh embedded in both through its launcher, then checks that the mesh works end to end.
# NOT RUN by kvmesh's authors: no machine they had could install TensorRT-LLM. Run it on one that can.
#
#   (install TensorRT-LLM from NVIDIA's package index first, then)
#   pip install 'kvmesh[trtllm]'                 # into the TensorRT-LLM environment
#   examples/trtllm/smoke.sh [MODEL]             # exit status 0 = pass
#
# Checks: both engines answer /kvmesh/info (backend trtllm, the configured block size); the mesh
# sees both workers with indexed blocks (the event bridge works); a repeated prompt is served from
# the prefix cache (cached_tokens > 0); /kvmesh/kv_state lists blocks with a sequence number;
# POST /kv_cache_events still answers; a pin answers with a block count. Logs go to $WORK.
set -euo pipefail

MODEL=${1:-Qwen/Qwen2.5-0.5B-Instruct}
GPU_A=${GPU_A:-0}
GPU_B=${GPU_B:-${GPU_A}}
WORK=${WORK:-$(mktemp -d -t kvmesh-trtllm-smoke.XXXXXX)}
A=http://127.0.0.1:8001
B=http://127.0.0.1:8002

cat >"$WORK/llm-options.yaml" <<YAML
kv_cache_config:
  tokens_per_block: 32
  free_gpu_memory_fraction: 0.3
YAML

serve() {  # serve URL GPU EVENTS_PORT LOG
  local url=$1 gpu=$2 events=$3 log=$4
  CUDA_VISIBLE_DEVICES=$gpu \
  python -m kvmesh.adapters.trtllm "$MODEL" --host 127.0.0.1 --port "${url##*:}" \
    --config "$WORK/llm-options.yaml" \
    --kvmesh-workers "$A,$B" --kvmesh-self-url "$url" \
    --kvmesh-events-endpoint "tcp://127.0.0.1:$events" \
    --kvmesh-replay-endpoint "tcp://127.0.0.1:$((events + 1))" >"$log" 2>&1 &
}

cleanup() { kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null || true; echo "logs: $WORK"; }
trap cleanup EXIT INT TERM

serve "$A" "$GPU_A" 5557 "$WORK/engine-a.log"
serve "$B" "$GPU_B" 5567 "$WORK/engine-b.log"

for url in "$A" "$B"; do
  for _ in $(seq 600); do curl -sf "$url/health" >/dev/null && break; sleep 1; done
  curl -sf "$url/kvmesh/info" | python -c '
import json, sys
info = json.load(sys.stdin)
assert info["backend"] == "trtllm", info
assert info["block_size"] == 32, info
print("info ok:", info)'
done

PROMPT="$(python -c 'print("You are a careful assistant. " * 60)')"
body() { python -c 'import json, sys; print(json.dumps({"model": sys.argv[1], "prompt": sys.argv[2], "max_tokens": 8}))' "$MODEL" "$PROMPT"; }
curl -sf "$A/v1/completions" -H 'content-type: application/json' -d "$(body)" >/dev/null
sleep 1
curl -sf "$A/v1/completions" -H 'content-type: application/json' -d "$(body)" | python -c '
import json, sys
usage = json.load(sys.stdin)["usage"]
cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
assert cached > 0, usage
print("cached_tokens:", cached)'

for _ in $(seq 30); do
  if curl -sf "$A/kvmesh/workers" | python -c '
import json, sys
workers = json.load(sys.stdin)["workers"]
sys.exit(0 if sum(w["indexed_blocks"] for w in workers) > 0 else 1)'; then break; fi
  sleep 1
done
curl -sf "$A/kvmesh/workers" | python -c '
import json, sys
workers = json.load(sys.stdin)["workers"]
assert sum(w["indexed_blocks"] for w in workers) > 0, workers
print("indexed blocks:", [(w["worker_id"], w["indexed_blocks"]) for w in workers])'

for url in "$A" "$B"; do
  curl -sf "$url/kvmesh/kv_state" | python -c '
import json, sys
state = json.load(sys.stdin)
print("kv_state ranks:", [(r["dp_rank"], r["last_seq"], len(r["events"])) for r in state["ranks"]])'
done
curl -sf -X POST "$A/kv_cache_events" >/dev/null && echo "POST /kv_cache_events ok"
curl -sf "$A/kvmesh/pin_prefix" -H 'content-type: application/json' \
  -d '{"token_ids": [1, 2, 3, 4, 5, 6, 7, 8], "ttl_seconds": 60}' && echo
echo "PASS"
