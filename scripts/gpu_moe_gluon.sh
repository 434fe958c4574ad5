#!/usr/bin/env bash
# One call on one H200 after a change to the routed MoE's gate-up: the GPU MoE tests (the Gluon kernel's bits against
# the Triton kernel's among them), the whole MoE against an earlier kernels/moe.py (bits and time), and one rank's
# replayed round at 1 and 64 lanes with the Gluon gate-up off and on.
# Usage, from the repo root there:  BEFORE=path/to/old_moe.py bash scripts/gpu_moe_gluon.sh   # logs under $OUT
set -u
: "${OUT:?set OUT to the folder for logs}"
: "${BEFORE:?set BEFORE to an earlier copy of kernels/moe.py}"
export PYTHONUNBUFFERED=1 PYTHONPATH=. TRITON_INTERPRET=0
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_moe_gpu.py > "$OUT/pytest.log" 2>&1
echo "pytest rc=$?"; tail -3 "$OUT/pytest.log"
timeout 180 python3 scripts/gpu_ab_moe.py --before "$BEFORE" --rows 1 2 8 64 256 1024 8192 > "$OUT/ab.log" 2>&1
echo "ab rc=$?"; cat "$OUT/ab.log" | tail -8
for gluon in 0 1; do
  FLASHNEXT_GLUON=$gluon timeout 240 python3 scripts/gpu_step_profile.py --out "$OUT/gluon$gluon" --alone-as 2 \
    --lanes 1 64 --rounds 10 --random-tokens 120000 > "$OUT/step$gluon.log" 2>&1
  echo "step profile FLASHNEXT_GLUON=$gluon rc=$?"; grep "^{" "$OUT/step$gluon.log" | cut -c1-400
done
