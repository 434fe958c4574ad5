#!/usr/bin/env bash
# One call on one H200 for the routed MoE: the A/B against an earlier kernels/moe.py (bits, µs a call), its GPU tests,
# the kernel check (error, row invariance, time against the floor), the forward check of the whole model, and a tile
# sweep. Usage, from the repo root there:  BEFORE=FILE bash scripts/gpu_moe.sh  # logs under $OUT
set -u
: "${OUT:?set OUT to the folder for logs}"
: "${BEFORE:?set BEFORE to an earlier kernels/moe.py}"
export PYTHONUNBUFFERED=1 PYTHONPATH=. CUDA_VISIBLE_DEVICES=0 TRITON_INTERPRET=0
start=$(date +%s)
since() { echo "at $(( $(date +%s) - start )) s"; }
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader

timeout ${AB_S:-150} python3 scripts/gpu_ab_moe.py --before "$BEFORE" --rows ${AB_ROWS:-1 8 64 1024 8192} \
  > "$OUT/ab.log" 2>&1
echo "== ab rc=$? $(since)"; tail -12 "$OUT/ab.log"

timeout ${TEST_S:-120} python3 -m pytest -q -m gpu tests/kernels/test_moe_gpu.py > "$OUT/test.log" 2>&1
echo "== test rc=$? $(since)"; tail -5 "$OUT/test.log"

timeout ${CHECK_S:-120} python3 scripts/gpu_check_moe.py --out "$OUT/check" > "$OUT/check.log" 2>&1
echo "== check rc=$? $(since)"; cut -c1-230 "$OUT/check.log" | tail -12

if [ -n "${FORWARD:-1}" ]; then
  timeout ${FORWARD_S:-200} python3 scripts/gpu_forward_check.py --out "$OUT/forward" --models shipped tiny --reps 1 \
    > "$OUT/forward.log" 2>&1
  echo "== forward rc=$? $(since)"; cut -c1-230 "$OUT/forward.log" | tail -14
fi

if [ -n "${SWEEP_ROWS:-}" ]; then
  timeout $(( ${BUDGET_S:-580} - $(date +%s) + start )) python3 scripts/gpu_sweep_moe.py --out "$OUT/sweep" \
    --rows $SWEEP_ROWS ${SWEEP_ARGS:-} > "$OUT/sweep.log" 2>&1
  echo "== sweep rc=$? $(since)"; cut -c1-230 "$OUT/sweep.log" | grep -v "^$" | tail -40
fi
