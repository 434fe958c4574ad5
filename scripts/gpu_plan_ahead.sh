#!/usr/bin/env bash
# Rounds planned ahead against rounds in turn (`--plan-ahead on` / `off`), served through HTTP on one GPU in one call.
# Each mode in MODES (default "on off on off") starts its own server and runs bench_concurrent at LEVELS (default
# "1 64") streams, greedy, "draft": false, REPS runs a level; then every stream's token_sha is compared across modes.
# MODEL=small (default) serves the shipped model at --tp 1 with CUDA graphs; MODEL=real serves rank 0's half of the
# real shapes alone (scripts/serve_alone.py --alone-as 2, dummy weights, 64 lanes, collectives skipped: time only).
# Usage, from the repo root there (carry .whl; build/small/data is not needed):  bash scripts/gpu_plan_ahead.sh
set -u
: "${OUT:?set OUT to the folder for logs}"
source scripts/gpu_serve.sh
git log --oneline -1 2>/dev/null || true
port=8700
pick_model
run=0
for mode in ${MODES:-on off on off}; do
  run=$((run + 1))
  name=${MODEL:-small}_${run}_$mode
  port=$((port + 1))
  serve_until_up "${SERVE_S:-300}" $port "$OUT/serve_$name.log" "${model_args[@]}" --plan-ahead "$mode" ${SERVE_ARGS:-} \
    && up=1 || up=0
  echo "== $name up=$up $(since)"
  if [ $up = 1 ]; then
    timeout 60 python3 scripts/bench_concurrent.py --base-url "http://127.0.0.1:$port" --random-prompt 128 \
      --vocab "${VOCAB:-$model_vocab}" --levels 1 --tokens 8 --reps 1 --temperatures 0 --drafts off > /dev/null 2>&1  # warm
    for n in ${LEVELS:-1 64}; do
      timeout 150 python3 scripts/bench_concurrent.py --base-url "http://127.0.0.1:$port" --random-prompt 128 \
        --vocab "${VOCAB:-$model_vocab}" --levels "$n" --tokens "${TOKENS:-128}" --reps "${REPS:-3}" --temperatures 0 \
        --drafts off --json > "$OUT/${name}_$n.out" 2>&1
      echo "$name, $n streams: rc=$? $(grep "^T=0 drafts off N=$n:" "$OUT/${name}_$n.out")"
    done
  fi
  stop_server
  grep -i "error\|Traceback" "$OUT/serve_$name.log" | head -5
done
# every stream's token_sha, level by level, must be the same in every mode
python3 scripts/same_tokens.py "$OUT"
echo "done $(since)"
