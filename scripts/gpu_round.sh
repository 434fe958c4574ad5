#!/usr/bin/env bash
# One call on the 2xH200 machine after a kernel-path change: the elementwise kernels' bits on GPU 0, the served
# round trace at real shapes with the shipped model's exactness checks (gpu_trace.sh), then the in-process step
# profile (replay times by lanes, verify rounds at 0..3 drafts, kernel table).
# Usage, from the repo root there (carry .whl and build/small/data):  bash scripts/gpu_round.sh  # logs under $OUT
set -u
: "${OUT:?set OUT to the folder for logs}"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
CUDA_VISIBLE_DEVICES=0 PYTHONPATH=. timeout 120 python3 scripts/gpu_check_elementwise.py --out "$OUT" \
  > "$OUT/elementwise.log" 2>&1
echo "elementwise rc=$?"; cut -c1-220 "$OUT/elementwise.log" | tail -20
bash scripts/gpu_trace.sh
PYTHONPATH=. timeout 300 torchrun --nproc-per-node 2 scripts/gpu_step_profile.py --out "$OUT" > "$OUT/step.log" 2>&1
echo "step profile rc=$?"; grep "^{" "$OUT/step.log"; head -30 "$OUT/step_profile.txt" 2>/dev/null | cut -c1-160
