#!/usr/bin/env bash
# GPU smoke test for kvmesh inside vLLM: two `vllm serve` engines with a small model, kvmesh
# embedded in both, then `kvmesh bench` through them and checks that routing follows the cache.
#
#   pip install 'kvmesh[vllm]'                   # into the vLLM 0.33.0 environment
#   examples/vllm/smoke.sh [MODEL]               # exit status 0 = pass
#
# Checks: both engines answer /kvmesh/info (vLLM backend, lower_first priority with
# --scheduling-policy priority); the mesh sees both workers up with indexed blocks; follow-up
# turns of a conversation land on the engine that served its first turn and are served from
# its prefix cache (cached_tokens > 0); /kvmesh/kv_state lists blocks with a sequence number;
# a pin answers with a block count. Logs go to $WORK (printed at the end).
set -euo pipefail

MODEL=${1:-Qwen/Qwen2.5-0.5B-Instruct}
GPU_A=${GPU_A:-0}
GPU_B=${GPU_B:-${GPU_A}}                      # one GPU is enough for a 0.5B model
GPU_MEMORY_UTILIZATION=${GPU_MEMORY_UTILIZATION:-0.35}
WORK=${WORK:-$(mktemp -d -t kvmesh-vllm-smoke.XXXXXX)}
A=http://127.0.0.1:8001
B=http://127.0.0.1:8002

export KVMESH_WORKERS="$A,$B"
export VLLM_PLUGINS=kvmesh

serve() {  # serve URL GPU EVENTS_PORT LOG
  local url=$1 gpu=$2 events=$3 log=$4
  CUDA_VISIBLE_DEVICES=$gpu KVMESH_SELF_URL=$url \
  vllm serve "$MODEL" --host 127.0.0.1 --port "${url##*:}" \
    --gpu-memory-utilization "$GPU_MEMORY_UTILIZATION" --max-model-len 8192 \
    --scheduling-policy priority \
    --kv-events-config "{\"enable_kv_cache_events\": true, \"publisher\": \"kvmesh\",
                         \"endpoint\": \"tcp://*:$events\", \"replay_endpoint\": \"tcp://*:$((events + 1))\"}" \
    --middleware kvmesh.adapters.vllm.KvMeshMiddleware >"$log" 2>&1 &
}

cleanup() { kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null || true; echo "logs: $WORK"; }
trap cleanup EXIT INT TERM

serve "$A" "$GPU_A" 5557 "$WORK/engine-a.log"
sleep 20  # let the first engine claim its GPU memory before the second measures what is free
serve "$B" "$GPU_B" 5567 "$WORK/engine-b.log"

for url in "$A" "$B"; do
  for _ in $(seq 600); do curl -sf "$url/health" >/dev/null && break; sleep 1; done
  curl -sf "$url/health" >/dev/null || { echo "FAIL: $url did not start"; tail -50 "$WORK"/engine-*.log; exit 1; }
done

check() { echo "check: $1"; }

check "/kvmesh/info on both engines"
for url in "$A" "$B"; do
  curl -sf "$url/kvmesh/info" | python3 -c '
import json, sys
info = json.load(sys.stdin)
assert info["backend"] == "vllm", info
assert info["priority_polarity"] == "lower_first", info
assert info["kv_events_endpoints"] and info["total_kv_blocks"] > 0, info
print("  ", info["model"], "block_size", info["block_size"], "blocks", info["total_kv_blocks"])'
done

check "kvmesh bench through both engines (agentic conversations)"
kvmesh bench --url "$A,$B" --workload agentic --sessions 16 --turns 4 --concurrency 4 \
  --max-tokens 32 --no-progress --json "$WORK/bench.json" | tee "$WORK/bench.txt"

python3 - "$WORK/bench.json" <<'PY'
import json, sys
from collections import defaultdict
doc = json.load(open(sys.argv[1]))
requests = [r for run in doc["runs"] for r in run["requests"]]
errors = [r for r in requests if r["error"]]
assert not errors, f"{len(errors)} requests failed, e.g. {errors[0]}"
by_session = defaultdict(list)
for r in requests:
    by_session[r["session"]].append(r)
sticky = total = cached = 0
for turns in by_session.values():
    turns.sort(key=lambda r: r["step"])
    first = turns[0]["worker_id"]
    for r in turns[1:]:
        total += 1
        sticky += r["worker_id"] == first
        cached += (r["cached_tokens"] or 0) > 0
print(f"   follow-up turns on the first turn's engine: {sticky}/{total}; served from cache: {cached}/{total}")
workers = {r["worker_id"] for r in requests}
assert len(workers) == 2, f"all sessions went to one engine: {workers}"
assert sticky >= 0.8 * total, "follow-up turns did not follow the cache"
assert cached >= 0.8 * total, "follow-up turns were not served from the prefix cache"
PY

check "the mesh sees both workers with indexed blocks"
curl -sf "$A/kvmesh/workers" | python3 -c '
import json, sys
rows = json.load(sys.stdin)["workers"]
assert len(rows) == 2 and all(r["state"] == "up" for r in rows), rows
indexed = [sum(rank["indexed_blocks"] for rank in r.get("ranks", [])) for r in rows]
print("   indexed blocks per worker:", indexed)'

check "/kvmesh/kv_state and /kvmesh/pin_prefix"
curl -sf "$A/kvmesh/kv_state" | python3 -c '
import json, sys
state = json.load(sys.stdin)
[rank] = state["ranks"]
blocks = sum(len(e["block_hashes"]) for e in rank["events"])
assert blocks > 0 and rank["last_seq"] is not None, rank.keys()
print("   cached blocks:", blocks, "last seq:", rank["last_seq"])'
TOKENS=$(python3 -c 'print(list(range(1000, 1000 + 256)))')
curl -sf "$A/v1/completions" -H 'content-type: application/json' -H 'x-worker-instance-id: '"$A" \
  -d "{\"model\": \"$MODEL\", \"prompt\": $TOKENS, \"max_tokens\": 1}" >/dev/null
curl -sf "$A/kvmesh/pin_prefix" -H 'content-type: application/json' \
  -d "{\"token_ids\": $TOKENS, \"ttl_seconds\": 30}" | python3 -c '
import json, sys
reply = json.load(sys.stdin)
assert reply["status"] == "ok" and reply["blocks_pinned"] > 0, reply
print("   pinned blocks:", reply["blocks_pinned"])'

echo "PASS"
