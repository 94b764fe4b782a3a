#!/usr/bin/env bash
# A 2-engine kvmesh mesh of SGLang servers: each engine embeds kvmesh's router and routes among both.
# Run the first command on host A and the second on host B (or both here with two GPUs).
#
#   pip install 'kvmesh[sglang]'     # into the SGLang 0.5.23 environment
set -euo pipefail
MODEL=${MODEL:-Qwen/Qwen2.5-7B-Instruct}
A=${A:-http://10.0.0.1:30000}
B=${B:-http://10.0.0.2:30000}
SELF=${1:?usage: mesh.sh A|B}
[ "$SELF" = A ] && url=$A || url=$B

# Every SGLang flag works as with `python -m sglang.launch_server`; --kvmesh-* flags are kvmesh's.
# The launcher adds --kv-events-config (kvmesh publisher on 5557, replay on 5557 + dp size).
exec python -m kvmesh.adapters.sglang \
  --model-path "$MODEL" --host 0.0.0.0 --port "${url##*:}" \
  --enable-priority-scheduling --enable-cache-report \
  --kvmesh-workers "$A,$B" --kvmesh-self-url "$url"
