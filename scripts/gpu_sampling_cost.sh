#!/usr/bin/env bash
# What the sampling extensions cost a served round: one server, then bench_concurrent at LEVELS (default "1 64")
# streams, greedy, "draft": false, for each of VARIANTS in turn, PASSES times (default 2): plain; logprobs (5 most
# likely with each token); bias (a logit bias on 64 ids); penalties (repetition, frequency and presence). MODEL=real (default) serves rank 0's half of the real shapes alone (scripts/serve_alone.py
# --alone-as 2, dummy weights, collectives skipped: time only); MODEL=small the shipped model with CUDA graphs.
# Usage, from the repo root there (carry .whl):  bash scripts/gpu_sampling_cost.sh
set -u
: "${OUT:?set OUT to the folder for logs}"
source scripts/gpu_serve.sh
git log --oneline -1 2>/dev/null || true
MODEL=${MODEL:-real}
pick_model
port=8750
bias=$(python3 -c "import json; print(json.dumps({'logit_bias': {str(7 + 997 * i): (i % 9) - 4.0 for i in range(64)}}))")
declare -A extra=(
  [plain]='{}'
  [logprobs]='{"logprobs": 5}'
  [bias]="$bias"
  [penalties]='{"repetition_penalty": 1.1, "frequency_penalty": 0.3, "presence_penalty": 0.2}'
)
serve_until_up "${SERVE_S:-300}" $port "$OUT/serve_cost.log" "${model_args[@]}" ${SERVE_ARGS:-} && up=1 || up=0
echo "== $MODEL up=$up $(since)"
if [ $up = 1 ]; then
  bench=(python3 scripts/bench_concurrent.py --base-url "http://127.0.0.1:$port" --random-prompt 128
         --vocab "$model_vocab" --temperatures 0 --drafts off)
  timeout 60 "${bench[@]}" --levels 1 --tokens 8 --reps 1 > /dev/null 2>&1  # warm
  for pass in $(seq 1 "${PASSES:-2}"); do
    for variant in ${VARIANTS:-plain logprobs bias penalties}; do
      for n in ${LEVELS:-1 64}; do
        timeout 150 "${bench[@]}" --levels "$n" --tokens "${TOKENS:-128}" --reps "${REPS:-2}" \
          --extra "${extra[$variant]}" --json > "$OUT/${variant}_${pass}_$n.out" 2>&1
        echo "$variant pass $pass, $n streams: rc=$? $(grep "^T=0 drafts off N=$n:" "$OUT/${variant}_${pass}_$n.out")"
      done
    done
  done
fi
stop_server
grep -i "error\|Traceback" "$OUT/serve_cost.log" | head -5
echo "done $(since)"
