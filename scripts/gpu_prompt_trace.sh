#!/usr/bin/env bash
# Where a served cold prompt's time goes, on rank 0's half of the real shapes alone (serve_alone.py, dummy weights,
# prompt cache off, FLASHNEXT_ROUND_TRACE): each prompt length in PROMPTS (default "1024 8192") sent cold REPEATS+1
# times (default 3), then the trace's rounds summarised by kind (trace_summary.py: host phases and GPU spans); then,
# with PROFILE_ROWS set (default 1024, at most 8192; empty skips it), gpu_step_profile.py's busy time of that many rows'
# eager prompt pass and of the MTP layer's pass over them, with the MTP pass's kernels. SERVE_ARGS defaults to an
# 80 GB GPU's `--max-lanes 8 --prompt-budget 1024`.
# Usage, from the repo root there (carry .whl):  bash scripts/gpu_prompt_trace.sh   # logs under $OUT
set -u
: "${OUT:?set OUT to the folder for logs}"
source scripts/gpu_serve.sh
export SERVE_CMD="python3 scripts/serve_alone.py --alone-as 2"
trace=$OUT/prompt_trace
mkdir -p "$trace"
url=http://127.0.0.1:8700
up=0
# shellcheck disable=SC2086
FLASHNEXT_ROUND_TRACE=$trace serve_until_up "${SERVE_S:-300}" 8700 "$OUT/serve_prompt.log" \
  configs/qwen3.8-flash-next --load-format dummy --device cuda --prompt-cache-gib 0 \
  ${SERVE_ARGS:---max-lanes 8 --prompt-budget 1024} && up=1
echo "server up=$up $(since)"
if [ $up = 1 ]; then
  timeout 60 python3 scripts/bench_cache.py --base-url $url --random-prompt 64 --vocab 200000 --tokens 1 \
    --repeats 0 --streams 0 > /dev/null 2>&1
  for p in ${PROMPTS:-1024 8192}; do
    : > "$trace/rank0.trace"
    timeout 200 python3 scripts/bench_cache.py --base-url $url --random-prompt "$p" --vocab 200000 --tokens 1 \
      --repeats "${REPEATS:-2}" --streams 0 > "$OUT/prompt_$p.out" 2>&1
    echo "== prompt $p rc=$? $(since)"; grep TTFT "$OUT/prompt_$p.out"
    python3 scripts/trace_summary.py "$trace/rank0.trace"
  done
fi
stop_server
grep -i "error\|Traceback" "$OUT/serve_prompt.log" | head -3
if [ -n "${PROFILE_ROWS-1024}" ]; then
  rows=${PROFILE_ROWS-1024}
  timeout 300 python3 scripts/gpu_step_profile.py --out "$OUT/profile" --alone-as 2 --lanes 1 --rounds 5 \
    --random-tokens 200000 --context 8192 --prompt "$rows" > "$OUT/profile.log" 2>&1
  echo "step profile rc=$? $(since)"
  grep -E '"prompt"|^busy time, a .*prompt|^busy time, the MTP' "$OUT/profile.log"
  grep -A14 "^kernels, the MTP" "$OUT/profile.log"
fi
