#!/usr/bin/env bash
# What one GPU can check of a change to the graphs, in one call on nvidia-h200: the GPU tests of the GDN
# kernel; prompt graphs against eager at the real shapes with the capture's memory (`gpu_prompt_graphs.py`, also
# from the tree in BEFORE when set, for an A/B of that memory); the trunk graphs against eager (`gpu_graph_check.py`);
# then the shipped model served at --tp 1 with CUDA graphs and MTP drafts (every graph kind: trunk, verify, prompt,
# mtp), checked by eval_small (drafted = "draft": false by token_sha, concurrent = solo at 1 and 8 streams).
# Usage, from the repo root there (carry .whl and build/small/data):  bash scripts/gpu_single.sh  # logs under $OUT
set -u
: "${OUT:?set OUT to the folder for logs}"
source scripts/gpu_serve.sh
start=$(date +%s)
since() { echo "at $(( $(date +%s) - start )) s"; }
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader

TRITON_INTERPRET=0 timeout 200 python3 -m pytest -q -m gpu tests/kernels/test_gdn_gpu.py \
  > "$OUT/pytest_gpu.out" 2>&1
echo "pytest -m gpu rc=$? $(since)"; tail -2 "$OUT/pytest_gpu.out"

timeout 240 python3 scripts/gpu_prompt_graphs.py --out "$OUT/after" > "$OUT/prompt_graphs.out" 2>&1
echo "prompt graphs rc=$? $(since)"; grep -v "it/s\]\|tensor/s\]" "$OUT/prompt_graphs.out" | tail -12
if [ -n "${BEFORE:-}" ]; then
  (cd "$BEFORE" && PYTHONPATH=/tmp/site:. timeout 240 python3 scripts/gpu_prompt_graphs.py --out "$OUT/before") \
    > "$OUT/prompt_graphs_before.out" 2>&1
  echo "prompt graphs of $BEFORE rc=$? $(since)"; grep -v "it/s\]\|tensor/s\]" "$OUT/prompt_graphs_before.out" | tail -12
fi

timeout 200 python3 scripts/gpu_graph_check.py --out "$OUT" > "$OUT/graph_check.out" 2>&1
echo "graph check rc=$? $(since)"; tail -4 "$OUT/graph_check.out"

port=8600
serve_until_up 200 $port "$OUT/serve_tp1.log" --tp 1 --device cuda --cuda-graphs on --drafter mtp && up=1 || up=0
echo "shipped model at --tp 1 up=$up $(since)"
grep "lane pool\|CUDA graphs" "$OUT/serve_tp1.log" | head -3
if [ $up = 1 ]; then
  timeout 200 python3 scripts/eval_small.py serve --data build/small/data --base-url "http://127.0.0.1:$port" \
    --prompts 6 --tokens 48 --streams 1,8 --json "$OUT/eval_tp1.json" 2>&1 | tail -8
  echo "eval rc=${PIPESTATUS[0]} $(since)"
fi
stop_server
grep -i "error\|Traceback" "$OUT/serve_tp1.log" | head -5
