#!/usr/bin/env bash
# Where a one-stream round planned ahead spends its host time, against one in turn, in one call on one GPU: each
# mode in MODES (default "on off") serves with FLASHNEXT_ROUND_TRACE, FLASHNEXT_ROUND_PROFILE=1 (the kernel and
# host-call tables of five one-lane rounds) and FLASHNEXT_ROUND_PYPROFILE=1 (Python's profile of twenty after them),
# one stream decodes greedy without drafts (DRAFTS=on: as the server drafts, so every round runs in turn), then the
# trace's phases are summarised and the tables printed. PROFILE=0 leaves torch.profiler out (its CUDA tracing may
# slow the rounds after it too); Python's profile then starts after the first round. MODEL=small (default) serves
# the shipped model at --tp 1 with CUDA graphs; MODEL=real rank 0's half of the real shapes alone
# (scripts/serve_alone.py --alone-as 2); SERVE_ARGS are added.
# Usage, from the repo root there (carry .whl):  bash scripts/gpu_plan_trace.sh   # logs under $OUT
set -u
: "${OUT:?set OUT to the folder for logs}"
source scripts/gpu_serve.sh
port=8830
pick_model
for mode in ${MODES:-on off}; do
  port=$((port + 1))
  trace=$OUT/trace_${MODEL:-small}_$mode
  mkdir -p "$trace"
  export FLASHNEXT_ROUND_TRACE=$trace FLASHNEXT_ROUND_PYPROFILE=1
  if [ "${PROFILE:-1}" = 1 ]; then export FLASHNEXT_ROUND_PROFILE=1; fi
  serve_until_up "${SERVE_S:-150}" $port "$OUT/serve_${MODEL:-small}_$mode.log" "${model_args[@]}" \
    --plan-ahead "$mode" ${SERVE_ARGS:-} && up=1 || up=0
  unset FLASHNEXT_ROUND_TRACE FLASHNEXT_ROUND_PROFILE FLASHNEXT_ROUND_PYPROFILE
  echo "== ${MODEL:-small} plan-ahead $mode up=$up $(since)"
  if [ $up = 1 ]; then
    timeout 90 python3 scripts/bench_concurrent.py --base-url "http://127.0.0.1:$port" --random-prompt 128 \
      --vocab "${VOCAB:-$model_vocab}" --levels 1 --tokens "${TOKENS:-128}" --reps 2 --temperatures 0 \
      --drafts "${DRAFTS:-off}" 2>&1 | grep "^T=0"
  fi
  stop_server
  python3 scripts/trace_summary.py "$trace/rank0.trace" --min-rounds 20 | head -30
  cat "$trace/rank0.profile.txt" 2>/dev/null
  cat "$trace/rank0.pyprofile.txt" 2>/dev/null
done
echo "done $(since)"
