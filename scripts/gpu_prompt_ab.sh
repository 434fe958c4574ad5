#!/usr/bin/env bash
# Cold prompts served on rank 0's half of the real shapes alone (serve_alone.py, dummy weights, prompt cache off),
# this tree against BEFORE's (another tree's folder), the trees in turn TURNS times (default 2): each server takes
# one warm-up request, then a cold PROMPT-token prompt (default 8192) REPEATS+1 times (default 4), each with its
# time to first token; then every reply's token_sha is compared across the servers (the trees' bits must agree).
# SERVE_ARGS defaults to an 80 GB GPU's `--max-lanes 8 --prompt-budget 1024`. Both trees run this tree's harness.
# Usage, from the repo root there (carry .whl and BEFORE):  BEFORE=build/before_conv bash scripts/gpu_prompt_ab.sh
set -u
: "${OUT:?set OUT to the folder for logs}" "${BEFORE:?set BEFORE to the other tree folder}"
cp -r .whl "$BEFORE/" && cp scripts/gpu_serve.sh scripts/serve_alone.py scripts/bench_cache.py scripts/openai_stream.py \
  "$BEFORE/scripts/"
source scripts/gpu_serve.sh
here=$PWD
export SERVE_CMD="python3 scripts/serve_alone.py --alone-as 2"
url=http://127.0.0.1:8600
for n in $(seq 1 "${TURNS:-2}"); do
  for tree in after before; do
    log=$OUT/serve_$tree$n.log
    up=0
    if [ "$tree" = before ]; then cd "$BEFORE" || exit 1; fi
    # shellcheck disable=SC2086
    serve_until_up "${SERVE_S:-240}" 8600 "$log" configs/qwen3.8-flash-next --load-format dummy --device cuda \
      --prompt-cache-gib 0 ${SERVE_ARGS:---max-lanes 8 --prompt-budget 1024} && up=1
    cd "$here" || exit 1
    echo "$tree$n up=$up $(since)"; grep "lane pool\|CUDA graphs" "$log" | head -2
    if [ $up = 1 ]; then
      timeout 60 python3 scripts/bench_cache.py --base-url $url --random-prompt 64 --vocab 200000 --tokens 1 \
        --repeats 0 --streams 0 > /dev/null 2>&1
      timeout 240 python3 scripts/bench_cache.py --base-url $url --random-prompt "${PROMPT:-8192}" --vocab 200000 \
        --tokens 1 --repeats "${REPEATS:-3}" --streams 0 --json "$OUT/prompt_$tree$n.json" > "$OUT/prompt_$tree$n.out" 2>&1
      echo "$tree$n bench rc=$?"; grep "TTFT" "$OUT/prompt_$tree$n.out" | sed "s/^/$tree$n /"
    fi
    stop_server
    grep -i "error\|Traceback" "$log" | head -3
  done
done
python3 - "$OUT" <<'EOF'
import json, pathlib, sys
shas = {p.stem: {r["token_sha"] for r in [d["first"], *d["repeats"]]}
        for p in sorted(pathlib.Path(sys.argv[1]).glob("prompt_*.json")) for d in [json.loads(p.read_text())]}
print("token_sha by server:", {k: sorted(v) for k, v in shas.items()})
print("one token_sha across servers and trees:", len(set().union(*shas.values())) == 1 if shas else "no replies")
EOF
