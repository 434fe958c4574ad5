#!/usr/bin/env bash
# One call on the 2xH200 machine at the end of a session: the in-process step profile (replays by lanes, verify
# rounds at 0..3 drafts, kernel tables at 1 and 64 lanes; random prompts and tokens by default, as served lanes
# route), then the served trace with the shipped model's exactness checks (gpu_trace.sh).
# Usage, from the repo root there (carry .whl and build/small/data):  bash scripts/gpu_last.sh
set -u
: "${OUT:?set OUT to the folder for logs}"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PYTHONPATH=. timeout ${STEP_S:-240} torchrun --nproc-per-node 2 scripts/gpu_step_profile.py --out "$OUT" \
  ${STEP_ARGS:---lanes 1 64 --random-tokens 200000} > "$OUT/step.log" 2>&1
echo "step profile rc=$? (a hang at teardown ends in 124)"; grep "^{\|^kernels\|^  " "$OUT/step.log" | cut -c1-130
pkill -9 -f gpu_step_profile 2>/dev/null
bash scripts/gpu_trace.sh
