#!/usr/bin/env bash
# One call on the 2xH200 machine at the end of a session: the in-process step profile (replays by lanes, verify
# rounds at 0..3 drafts, kernel tables at 1 and 64 lanes; random prompts and tokens by default, as served lanes
# route), the same with the combines summed inside the hyper writes (`--peer-sums`, once
# tests/kernels/test_peer_two_gpus.py has passed; PEER_SUMS=0 skips both), then the served trace with the shipped
# model's exactness checks (gpu_trace.sh; FLASHNEXT_PEER_SUMS=1 in the environment serves with peer sums).
# Usage, from the repo root there (carry .whl and build/small/data):  bash scripts/gpu_last.sh
set -u
: "${OUT:?set OUT to the folder for logs}"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PYTHONPATH=. timeout ${STEP_S:-240} torchrun --nproc-per-node 2 scripts/gpu_step_profile.py --out "$OUT" \
  ${STEP_ARGS:---lanes 1 64 --random-tokens 200000} > "$OUT/step.log" 2>&1
echo "step profile rc=$? (a hang at teardown ends in 124)"; grep "^{\|^kernels\|^  " "$OUT/step.log" | cut -c1-130
pkill -9 -f gpu_step_profile 2>/dev/null
if [[ ${PEER_SUMS:-1} == 1 ]]; then
  PYTHONPATH=. TRITON_INTERPRET=0 timeout 360 python3 -m pytest -q -m gpu tests/kernels/test_peer_two_gpus.py \
    > "$OUT/peer_two_gpus.log" 2>&1
  echo "peer sums on two GPUs rc=$? (the profile with them runs only after a pass)"; tail -3 "$OUT/peer_two_gpus.log"
  PEER_SUMS=$(grep -q "1 passed" "$OUT/peer_two_gpus.log" && echo 1 || echo 0)
fi
if [[ ${PEER_SUMS:-1} == 1 ]]; then
  PYTHONPATH=. timeout ${STEP_S:-240} torchrun --nproc-per-node 2 scripts/gpu_step_profile.py --out "$OUT/peer" \
    --peer-sums ${STEP_ARGS:---lanes 1 64 --random-tokens 200000} > "$OUT/peer_step.log" 2>&1
  echo "step profile with peer sums rc=$?"; grep "^{\|^kernels\|^  " "$OUT/peer_step.log" | cut -c1-130
  pkill -9 -f gpu_step_profile 2>/dev/null
fi
bash scripts/gpu_trace.sh
