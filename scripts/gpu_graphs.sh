#!/usr/bin/env bash
# CUDA graphs on the 2xH200 machine in one call: the eager-against-replayed check on GPU 0 (bits and round times,
# the shipped model), then the shipped model served at --tp 2 with --cuda-graphs on and off, measured by
# eval_small.py (drafted = "draft": false by token_sha, speed at 1 and 8 streams), each rank writing a digest of
# every round (FLASHNEXT_ROUND_DIGESTS) that must match the other rank's line for line.
# Usage, from the repo root there (carry .whl and build/small/data):  bash scripts/gpu_graphs.sh  # logs under $OUT
set -u
: "${OUT:?set OUT to the folder for logs}"
source scripts/gpu_serve.sh
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
git log --oneline -1 2>/dev/null || true

CUDA_VISIBLE_DEVICES=0 timeout 240 python3 scripts/gpu_graph_check.py --out "$OUT" > "$OUT/graph_check.out" 2>&1
echo "graph check rc=$?"
tail -8 "$OUT/graph_check.out"

port=8300
for graphs in ${GRAPHS:-on off}; do
  port=$((port + 1))
  small_exactness "graphs_$graphs" "$port" --device cuda --cuda-graphs "$graphs"
  grep -v "it/s\]\|tensor/s\]" "$OUT/serve_graphs_$graphs.log" | grep -i "graph\|pool\|error\|Traceback" | head -8
done
