#!/usr/bin/env bash
# Where a served round's time goes, on the 2xH200 machine in one call: serve the real shapes at --tp 2 (dummy
# weights, CUDA graphs, 64 lanes, prompt cache off) with FLASHNEXT_ROUND_TRACE; decode greedy at 1, 4, 8, 32 and 64
# streams (LEVELS) and sampled at 1 and 64 (SAMPLED) without drafts, and greedy at 1 stream with drafts; summarise
# both ranks' round phases; time cold 1k and 8k prompts (PROMPTS). Then serve the shipped model at --tp 2 and check
# drafted = undrafted and concurrent = solo (eval_small) with the ranks' round digests compared (SMALL=0 skips it).
# FLASHNEXT_ROUND_PROFILE=LANES in the environment adds the kernel tables of served rounds (rank{r}.profile.txt).
# ALONE=2 serves rank 0's half alone on one GPU instead (scripts/serve_alone.py: collectives skipped, no rank 1,
# timing only) and skips the shipped model's two-rank checks.
# Usage, from the repo root there (carry .whl and build/small/data):  bash scripts/gpu_trace.sh  # logs under $OUT
set -u
: "${OUT:?set OUT to the folder for logs}"
source scripts/gpu_serve.sh
git log --oneline -1 2>/dev/null || true

trace=$OUT/trace
mkdir -p "$trace"
port=8500
url=http://127.0.0.1:$port
up=0
ranks="0 1" tp="--tp 2"
if [ -n "${ALONE:-}" ]; then
  export SERVE_CMD="python3 scripts/serve_alone.py --alone-as $ALONE"
  ranks=0 tp="" SMALL=0
fi
# shellcheck disable=SC2086
FLASHNEXT_ROUND_TRACE=$trace serve_until_up "${SERVE_S:-330}" $port "$OUT/serve_real.log" configs/qwen3.8-flash-next \
  --load-format dummy $tp --device cuda --max-lanes 64 --drafts 3 --prompt-cache-gib 0 ${SERVE_ARGS:-} && up=1
echo "real server up=$up $(since)"
grep "lane pool\|CUDA graphs" "$OUT/serve_real.log" | head -3
if [ $up = 1 ]; then
  conc() {  # name, then bench_concurrent flags
    local name=$1; shift
    timeout 120 python3 scripts/bench_concurrent.py --base-url $url --random-prompt 128 --vocab 200000 --reps 1 \
      --temperatures 0 --json "$@" > "$OUT/$name.out" 2>&1
    echo "== $name rc=$? $(since)"
    grep -v "^{\|  stream" "$OUT/$name.out" | tail -6
  }
  conc warm --levels 1 --tokens 8 --drafts both
  for n in ${LEVELS:-1 4 8 32 64}; do
    : > "$trace/rank0.trace"; : > "$trace/rank1.trace"
    conc "off_$n" --levels $n --tokens ${TOKENS:-64} --drafts off
    for r in $ranks; do
      cp "$trace/rank$r.trace" "$trace/off_${n}_rank$r.trace"
      echo "-- rank $r, $n streams:"; python3 scripts/trace_summary.py "$trace/rank$r.trace" --min-rounds 3 | head -5
    done
  done
  for n in ${SAMPLED:-1 64}; do  # sampled (temperature 1), no trace summary
    conc "t1_$n" --levels $n --tokens ${TOKENS:-64} --drafts off --temperatures 1
  done
  : > "$trace/rank0.trace"; : > "$trace/rank1.trace"
  conc on_1 --levels 1 --tokens ${TOKENS:-64} --drafts on
  cp "$trace/rank0.trace" "$trace/on_1_rank0.trace"
  echo "-- rank 0, 1 stream drafted:"; python3 scripts/trace_summary.py "$trace/rank0.trace" --min-rounds 2 | head -8
  curl -s $url/metrics | grep -E "^flashnext:(round_seconds_(sum|count)|spec_decode_num)" > "$OUT/metrics.txt"
  for p in ${PROMPTS:-1024 8192}; do  # cold prompts (prompt cache off): the repeat is the second cold pass
    timeout 150 python3 scripts/bench_cache.py --base-url $url --random-prompt $p --vocab 200000 --tokens 1 \
      --repeats 1 --streams 0 > "$OUT/prompt_$p.out" 2>&1
    echo "== prompt $p rc=$? $(since)"; tail -4 "$OUT/prompt_$p.out"
  done
fi
stop_server
grep -i "error\|Traceback" "$OUT/serve_real.log" | head -5

if [ "${SMALL:-1}" = 1 ]; then  # SMALL=0 skips the shipped model's exactness checks
  small_exactness small 8501 --device cuda --cuda-graphs on
  echo "shipped model checked $(since)"
fi
for r in $ranks; do [ -f "$trace/rank$r.profile.txt" ] && head -32 "$trace/rank$r.profile.txt"; done
tar czf "$OUT/trace.tgz" -C "$OUT" trace
rm -rf "$trace"
(cd "$OUT" && tar czf logs.tgz --remove-files ./*.out ./*.log ./*.txt 2>/dev/null)  # few files come back: pack them
