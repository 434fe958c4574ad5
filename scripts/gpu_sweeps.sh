#!/usr/bin/env bash
# One call on one H200: the hyper-read sweep with the linear-kernel paths, the routed-MoE tile sweep, and the draw
# check (greedy rows with host temperatures). Usage, from the repo root there:  bash scripts/gpu_sweeps.sh  # $OUT
set -u
: "${OUT:?set OUT to the folder for logs}"
export PYTHONUNBUFFERED=1 PYTHONPATH=. CUDA_VISIBLE_DEVICES=0
start=$(date +%s)
since() { echo "at $(( $(date +%s) - start )) s"; }
git log --oneline -1 2>/dev/null || true
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader

timeout ${HYPER_S:-150} python3 scripts/gpu_sweep_hyper.py --out "$OUT/hyper" --rows ${HYPER_ROWS:-1 64 256} \
  --warps 4 --stages 3 4 --via-linear > "$OUT/hyper.log" 2>&1
echo "== hyper rc=$? $(since)"; cut -c1-230 "$OUT/hyper.log" | grep -v "^$" | tail -40

timeout ${MOE_S:-300} python3 scripts/gpu_sweep_moe.py --out "$OUT/moe" --rows ${MOE_ROWS:-64 1 8} \
  ${MOE_ARGS:-} > "$OUT/moe.log" 2>&1
echo "== moe rc=$? $(since)"; cut -c1-230 "$OUT/moe.log" | grep -v "^$" | tail -40

timeout $(( ${BUDGET_S:-560} - $(date +%s) + start )) python3 scripts/gpu_check_router_sample.py --out "$OUT/sample" --only sample \
  > "$OUT/sample.log" 2>&1
echo "== sample rc=$? $(since)"; cut -c1-260 "$OUT/sample.log" | tail -16
