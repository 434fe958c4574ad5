#!/usr/bin/env bash
# The shipped small model on the 2xH200 machine in one call: optionally the kernel path's forward check on GPU 0,
# then the model served at --tp 2 and measured by eval_small.py (MTP acceptance per position, drafted against
# "draft": false at 1 and 8 streams), once per --kernels setting given.
# Usage, from the repo root there (carry .whl and build/small/data):
#   bash scripts/gpu_small_check.sh "on off" [forward]     # logs and JSON under $OUT
set -u
: "${OUT:?set OUT to the folder for logs}"
KERNELS=${1:-"on off"}
source scripts/gpu_serve.sh
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
git log --oneline -1 2>/dev/null || true

if [ "${2:-}" = forward ]; then
  CUDA_VISIBLE_DEVICES=0 timeout 240 python3 scripts/gpu_forward_check.py --out "$OUT" --models shipped \
    --prompts 2 --steps 6 --reps 5 > "$OUT/forward_check.out" 2>&1
  echo "forward check rc=$?"
  tail -5 "$OUT/forward_check.out"
fi

port=8100
for kernels in $KERNELS; do
  port=$((port + 1))
  up=0
  serve_until_up 280 "$port" "$OUT/serve_$kernels.log" --tp 2 --device cuda --kernels "$kernels" --drafter mtp && up=1
  echo "kernels=$kernels server up=$up"
  if [ $up = 1 ]; then
    timeout 220 python3 scripts/eval_small.py serve --data build/small/data --base-url "http://127.0.0.1:$port" \
      --prompts 6 --tokens 48 --streams 1,8 --json "$OUT/eval_tp2_$kernels.json" 2>&1 | tail -8
    echo "eval rc=${PIPESTATUS[0]}"
  fi
  stop_server
  tail -4 "$OUT/serve_$kernels.log"
done
