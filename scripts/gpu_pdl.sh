#!/usr/bin/env bash
# Programmatic dependent launch on the 2xH200 machine in one call: the GPU test (a captured chain with PDL equals
# it plain), then the in-process step profile at 1 and 64 lanes with PDL off, with PDL on (weight prefetch too),
# and with PDL on at 64 lanes fed random tokens (as served random prompts route). Logs under $OUT.
# Usage, from the repo root there (carry .whl):  bash scripts/gpu_pdl.sh
set -u
: "${OUT:?set OUT to the folder for logs}"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=.:/tmp/site
start=$(date +%s)
since() { echo "at $(( $(date +%s) - start )) s"; }

TRITON_INTERPRET=0 timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_pdl.py 2>&1 | tail -3
echo "gpu test $(since)"

profile() {  # name, env assignments..., then -- and gpu_step_profile flags
  local name=$1; shift
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  mkdir -p "$OUT/$name"
  env "${envs[@]}" timeout "${STEP_S:-170}" torchrun --nproc-per-node 2 scripts/gpu_step_profile.py \
    --out "$OUT/$name" "$@" > "$OUT/$name/step.log" 2>&1
  echo "== $name rc=$? (124: the known hang at teardown) $(since)"
  grep "^{\|^kernels\|^  " "$OUT/$name/step.log" | cut -c1-120 | head -40
  pkill -9 -f gpu_step_profile 2>/dev/null
  sleep 2
}
profile pdl_off FLASHNEXT_PDL=0 -- --lanes 1 64
profile pdl_on FLASHNEXT_PDL=1 -- --lanes 1 64
profile pdl_random FLASHNEXT_PDL=1 -- --lanes 64 --random-tokens 200000
