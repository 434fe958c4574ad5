#!/usr/bin/env bash
# A short GPU call: the hyper-read tile sweep on GPU 0 (a few warps/stages), then the served round trace at real
# shapes with the shipped model's exactness checks (gpu_trace.sh). Usage, from the repo root there (carry .whl and
# build/small/data):  bash scripts/gpu_final.sh   # logs under $OUT
set -u
: "${OUT:?set OUT to the folder for logs}"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
CUDA_VISIBLE_DEVICES=0 PYTHONPATH=. timeout ${SWEEP_S:-150} python3 scripts/gpu_sweep_hyper.py --out "$OUT" \
  --rows 1 64 --warps ${WARPS:-2 4 8} --stages ${STAGES:-3 4} > "$OUT/sweep.log" 2>&1
echo "sweep rc=$?"; cut -c1-200 "$OUT/sweep.log" | grep -v "^$" | tail -24
bash scripts/gpu_trace.sh
