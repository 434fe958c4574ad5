# Shared by the GPU scripts (source it from the repo root on the GPU machine): the environment, the carried
# wheels, `since` (seconds since this file was sourced), and `serve_until_up SECONDS PORT LOG ARGS...`, which starts
# `python3 -m server ARGS` (or `$SERVE_CMD ARGS`) with a time limit and waits until /health answers (SERVER holds
# its pid; returns 1 if it died or never came up); `small_exactness NAME PORT ARGS...` serves the shipped model at
# --tp 2 with ARGS and checks it (below); `pick_model` sets the served model's flags from MODEL (small or real).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:.
start=$(date +%s)
since() { echo "at $(( $(date +%s) - start )) s"; }

serve_until_up() {
  local limit=$1 port=$2 log=$3
  shift 3
  timeout "$limit" ${SERVE_CMD:-python3 -m server} --host 127.0.0.1 --port "$port" "$@" > "$log" 2>&1 &
  SERVER=$!
  for _ in $(seq 1 300); do
    python3 -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:$port/health').status_code != 200)" \
      2>/dev/null && return 0
    kill -0 $SERVER 2>/dev/null || return 1
    sleep 1
  done
  return 1
}

pick_model() {  # MODEL=small (default): the shipped model at --tp 1, CUDA graphs, 64 lanes; MODEL=real: rank 0's
  # half of the real shapes alone (serve_alone.py --alone-as 2, dummy weights). Sets model_args, model_vocab, SERVE_CMD
  model_args=(--tp 1 --device cuda --cuda-graphs on --max-lanes 64)
  model_vocab=4000
  if [ "${MODEL:-small}" = real ]; then
    export SERVE_CMD="python3 scripts/serve_alone.py --alone-as 2"
    model_args=(configs/qwen3.8-flash-next --load-format dummy --device cuda --max-lanes 64 --prompt-cache-gib 0)
    model_vocab=200000
  fi
}

stop_server() {  # SIGTERM, then the server's exit status (SIGKILL if it still runs STOP_S, default 45, seconds later)
  kill $SERVER 2>/dev/null
  for _ in $(seq 1 "${STOP_S:-45}"); do kill -0 $SERVER 2>/dev/null || break; sleep 1; done
  if kill -0 $SERVER 2>/dev/null; then
    echo "server still running ${STOP_S:-45} s after SIGTERM: killed"
    kill -9 $SERVER 2>/dev/null
  fi
  wait $SERVER 2>/dev/null
  echo "server exit status $?"
  pkill -9 -f "m server" 2>/dev/null  # a rank its launcher left behind, or one the SIGKILL above orphaned
}

# The shipped model served at --tp 2 with the MTP drafter and ARGS, each rank writing a digest of every round:
# eval_small (drafted = "draft": false by token_sha, concurrent = solo at 1 and 8 streams), then the ranks' digests
# compared line for line. Logs: $OUT/serve_NAME.log, $OUT/eval_NAME.json.
small_exactness() {
  local name=$1 port=$2 digests up=0
  shift 2
  digests=$(mktemp -d)
  FLASHNEXT_ROUND_DIGESTS=$digests serve_until_up 260 "$port" "$OUT/serve_$name.log" --tp 2 --drafter mtp "$@" && up=1
  echo "$name server up=$up"
  if [ $up = 1 ]; then
    timeout 200 python3 scripts/eval_small.py serve --data build/small/data --base-url "http://127.0.0.1:$port" \
      --prompts 6 --tokens 48 --streams 1,8 --json "$OUT/eval_$name.json" 2>&1 | tail -8
    echo "eval rc=${PIPESTATUS[0]}"
  fi
  stop_server
  echo "rounds digested: rank0 $(wc -l < "$digests/rank0.digests") rank1 $(wc -l < "$digests/rank1.digests")"
  cmp "$digests/rank0.digests" "$digests/rank1.digests" && echo "ranks identical: yes" || echo "ranks identical: NO"
}
