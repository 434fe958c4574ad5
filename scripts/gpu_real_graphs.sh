#!/usr/bin/env bash
# The real shapes at --tp 2 with dummy weights and CUDA graphs on the 2xH200 machine, in one call: serve
# configs/qwen3.8-flash-next (--max-lanes 64, context sized from free memory, prompt cache off so every prompt is
# cold), then through the HTTP API: decode at 1, 4, 8, 32 and 64 streams greedy and sampled without drafts, one and
# 64 streams with drafts, cold prompts of 1k (time to first token), 2k and 8k tokens, and /metrics (round times,
# collectives). Usage, from the repo root there (carry .whl):  bash scripts/gpu_real_graphs.sh  # logs under $OUT
set -u
: "${OUT:?set OUT to the folder for logs}"
source scripts/gpu_serve.sh
port=8400
url=http://127.0.0.1:$port
up=0
serve_until_up "${SERVE_S:-570}" $port "$OUT/serve_real.log" configs/qwen3.8-flash-next --load-format dummy --tp 2 \
  --device cuda --max-lanes 64 --drafts 3 --prompt-cache-gib 0 ${SERVE_ARGS:-} && up=1
echo "server up=$up $(since)"
grep "lane pool\|CUDA graphs\|context" "$OUT/serve_real.log" | head -4
nvidia-smi --query-gpu=index,memory.used --format=csv,noheader
if [ $up = 1 ]; then
  conc() {  # name, then bench_concurrent flags
    local name=$1; shift
    timeout "${CONC_S:-150}" python3 scripts/bench_concurrent.py --base-url $url --random-prompt 128 --vocab 200000 \
      --reps 1 --json "$@" > "$OUT/$name.out" 2>&1
    echo "== $name rc=$? $(since)"
    tail -1 "$OUT/$name.out" > "$OUT/$name.json"
    grep -v "^{" "$OUT/$name.out" | tail -14
  }
  conc warm --levels 1 --tokens 8 --temperatures 0 --drafts both
  conc decode_off --levels 1,4,8,32,64 --tokens ${TOKENS:-64} --temperatures 0,1.0 --drafts off
  conc decode_drafted --levels 1,64 --tokens ${TOKENS:-64} --temperatures 0 --drafts on
  curl -s $url/metrics | grep -E "^flashnext:(round_seconds_(sum|count)|collective|spec_decode_num)" > "$OUT/metrics.txt"
  cat "$OUT/metrics.txt"
  for n in 1024 2048 8192; do
    for pass in warm timed; do  # the first pass compiles the kernels for a prompt round's shapes
      seed=$([ $pass = warm ] && echo $n || echo $((n + 1)))
      timeout 120 python3 scripts/bench_cache.py --base-url $url --vocab 200000 --streams 0 --repeats 0 --tokens 1 \
        --seed $seed --random-prompt $n --json "$OUT/cold_${n}_$pass.json" > /dev/null 2>&1
    done
    echo "== cold $n: $(python3 -c "import json; r=json.load(open('$OUT/cold_${n}_timed.json')); print(r)" | head -c 400) $(since)"
  done
fi
stop_server
grep -v "it/s\]\|tensor/s\]\|expert/s\]" "$OUT/serve_real.log" | tail -12
