#!/usr/bin/env bash
# Every kernel on one H200 at tp=2's per-rank shapes: against its reference, row invariance, time against the floor.
# Usage (on the GPU machine, from the repo root): OUT=/some/dir bash scripts/gpu_check.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
out=${OUT:-/tmp/gpu_check}
mkdir -p "$out"
status=0
for kernel in linear moe gdn qsa hyper router_sample; do
  echo "== $kernel"
  timeout 900 python3 "scripts/gpu_check_${kernel}.py" --out "$out" 2>&1 | tee "$out/${kernel}.log" || status=1
done
exit $status
