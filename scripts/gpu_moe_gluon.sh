#!/usr/bin/env bash
# One call on one H200 after a change to the routed MoE's Gluon kernels: the GPU MoE tests (the Gluon kernels' bits
# against the Triton kernels' among them), each projection alone at 2 to 819 rows (scripts/gpu_gluon_sweep.py, its
# flags from SWEEP_FLAGS), the whole MoE against an earlier kernels/moe.py (bits and time), issue 6's MoE table
# (gpu_check_moe.py), then, while the call has time left (STEP_BY seconds since it began), one rank's replayed round
# at 64 and 1 lanes with the Gluon kernels off and on (the kernel tables of the second kept, the first's left on the
# device: too many files come back otherwise).
# Usage, from the repo root there:  BEFORE=path/to/old_moe.py bash scripts/gpu_moe_gluon.sh   # logs under $OUT
set -u
: "${OUT:?set OUT to the folder for logs}"
: "${BEFORE:?set BEFORE to an earlier copy of kernels/moe.py}"
STEP_BY=${STEP_BY:-300}
export PYTHONUNBUFFERED=1 PYTHONPATH=. TRITON_INTERPRET=0
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_moe_gpu.py > "$OUT/pytest.log" 2>&1
echo "pytest rc=$? at ${SECONDS}s"; tail -3 "$OUT/pytest.log"
# shellcheck disable=SC2086  # SWEEP_FLAGS is a list of flags
timeout 150 python3 scripts/gpu_gluon_sweep.py ${SWEEP_FLAGS:-} > "$OUT/gluon_sweep.log" 2>&1
echo "gluon sweep rc=$? at ${SECONDS}s"; tail -12 "$OUT/gluon_sweep.log"
timeout 150 python3 scripts/gpu_ab_moe.py --before "$BEFORE" --rows 1 2 4 8 16 32 64 128 256 307 384 512 819 1024 8192 \
  > "$OUT/ab.log" 2>&1
echo "ab rc=$? at ${SECONDS}s"; tail -15 "$OUT/ab.log"
timeout 150 python3 scripts/gpu_check_moe.py --out "$OUT/check" > "$OUT/check.log" 2>&1
echo "check rc=$? at ${SECONDS}s"; grep nvfp4 "$OUT/check.log" | cut -c1-200
for gluon in 0 1; do
  if [ "$SECONDS" -gt "$STEP_BY" ]; then echo "no time left for the step profile"; break; fi
  FLASHNEXT_GLUON=$gluon timeout 150 python3 scripts/gpu_step_profile.py --out "/tmp/gluon$gluon" --alone-as 2 \
    --lanes 64 1 --rounds 5 --random-tokens 120000 > "$OUT/step$gluon.log" 2>&1
  echo "step profile FLASHNEXT_GLUON=$gluon rc=$? at ${SECONDS}s"; grep "^{" "$OUT/step$gluon.log" | cut -c1-300
done
cp /tmp/gluon1/step_profile_64.txt /tmp/gluon1/step_profile.txt "$OUT/" 2>/dev/null
