#!/usr/bin/env bash
# Nsight Compute over the routed MoE, the dense linear kernel, the router and the hyper-connection read (`gpu_ncu.py`)
# and GDN's chunked form (`gpu_check_gdn.py --names prompt`) on one H200: per kernel launch, speed of light, occupancy,
# scheduler and warp stall statistics and the instruction mix (CSV), and each kernel's SASS with its stall samples.
# Logs under $OUT.
# Usage, from the repo root there:  OUT=... [PARTS="moe gdn hyper router"] bash scripts/gpu_ncu.sh  (default: moe gdn)
# Then, anywhere:  python3 scripts/ncu_summary.py $OUT/NAME.csv $OUT/NAME_sass.csv  (per launch: figures, stalls, mix)
set -u
: "${OUT:?set OUT to the folder for logs}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 FLASHNEXT_PDL=0 PYTHONPATH=.
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)
echo "ncu: $NCU"; "$NCU" --version | tail -1
SECTIONS=(--section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats
  --section WarpStateStats --section InstructionStats --section MemoryWorkloadAnalysis --section SourceCounters)
profile() {  # name, limit, kernel regex, then the command
  local name=$1 limit=$2 kernels=$3
  shift 3
  # shellcheck disable=SC2086
  timeout "$limit" "$NCU" --clock-control none "${SECTIONS[@]}" ${NCU_FLAGS:-} -k "regex:$kernels" \
    -f -o "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$?"; grep "^case\|==ERROR==\|Error" "$OUT/$name.log" | head -20
  "$NCU" --import "$OUT/$name.ncu-rep" --csv --page details --print-units base > "$OUT/$name.csv" 2>&1
  "$NCU" --import "$OUT/$name.ncu-rep" --csv --page source --print-source sass > "$OUT/${name}_sass.csv" 2>&1
  echo "$name exported rc=$? $(wc -c < "$OUT/$name.csv") $(wc -c < "$OUT/${name}_sass.csv") bytes"
}
parts=" ${PARTS:-moe gdn} "
[[ $parts == *" moe "* ]] && profile moe_linear 300 '_(gate_up|down|combine|plan|linear|split_sum)' \
  python3 scripts/gpu_ncu.py --moe-rows ${MOE_ROWS:-1 64 1024} \
  --linear ${LINEAR:-2560x3072:1 5120x2560:1 6144x2560:1 2560x3072:64}
# one hyper-connection read at HYPER_ROWS rows (default 1), its three kernels, after four reads that warm L2
[[ $parts == *" hyper "* ]] && NCU_FLAGS="--cache-control none --launch-skip 12 --launch-count 6" \
  profile hyper_read 200 '_(rstd|linear|up_mix)_kernel' \
  python3 scripts/gpu_ncu.py --moe-rows --hyper-rows "${HYPER_ROWS:-1}" --repeats 6
# the router's logits with their top-k at one row (its last arrival picks), after four launches that warm L2
[[ $parts == *" router "* ]] && NCU_FLAGS="--cache-control none --launch-skip 4 --launch-count 2" \
  profile router 200 '_linear_kernel' python3 scripts/gpu_ncu.py --moe-rows --router-rows 1 --repeats 6
# the chunked form's two kernels at 1,024 and 8,192 rows (the recurrence's launches are left out)
[[ $parts == *" gdn "* ]] && profile gdn_chunks 240 '_gdn_chunk_' --launch-count 4 python3 scripts/gpu_check_gdn.py \
  --out "$OUT/gdn" --names prompt --reps 3
