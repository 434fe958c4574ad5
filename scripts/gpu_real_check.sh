#!/usr/bin/env bash
# The real shapes at --tp 2 with dummy weights on the 2xH200 machine, in one call: serve
# configs/qwen3.8-flash-next with --load-format dummy, then time prompts cold at 2k and 8k tokens and a 32k-token
# prompt cold against the same prompt resumed with 64 new tokens (bench_cache.py), and one stream's decode.
# Usage, from the repo root there (carry .whl):  bash scripts/gpu_real_check.sh   # logs and JSON under $OUT
set -u
: "${OUT:?set OUT to the folder for logs}"
source scripts/gpu_serve.sh
port=8200
url=http://127.0.0.1:$port
start=$(date +%s)
up=0
serve_until_up "${SERVE_S:-520}" $port "$OUT/serve_real.log" configs/qwen3.8-flash-next --load-format dummy --tp 2 \
  --device cuda --context 40000 --max-lanes 8 --drafts 0 && up=1
echo "server up=$up after $(( $(date +%s) - start )) s"
nvidia-smi --query-gpu=index,memory.used --format=csv,noheader
if [ $up = 1 ]; then
  bench() {  # name, then bench_cache flags
    local name=$1; shift
    echo "== $name"
    timeout 200 python3 scripts/bench_cache.py --base-url $url --vocab 200000 --streams 0 --json "$dir/$name.json" "$@"
    echo "rc=$? at $(( $(date +%s) - start )) s"
  }
  for pass in warm timed; do  # the first pass compiles the kernels for these shapes; the second is the figure
    base=$([ $pass = warm ] && echo 10 || echo 20)
    dir=$([ $pass = warm ] && echo /tmp || echo "$OUT")
    bench ${pass}_decode --seed $((base + 1)) --random-prompt 16 --tokens 32 --repeats 1
    bench ${pass}_resume32k --seed $((base + 2)) --random-prompt 32768 --extend 64 --tokens 1 --repeats 1
    bench ${pass}_cold2k --seed $((base + 3)) --random-prompt 2048 --tokens 1 --repeats 0
    bench ${pass}_cold8k --seed $((base + 4)) --random-prompt 8192 --tokens 1 --repeats 0
  done
fi
stop_server
grep -v "it/s\]\|tensor/s\]\|expert/s\]" "$OUT/serve_real.log" | tail -25
