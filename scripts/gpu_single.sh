#!/usr/bin/env bash
# What one GPU can check of a change, in one call on nvidia-h200. CHECKS picks among (default: all, in this order):
#   pytest        `pytest -m gpu` of PYTEST_FILES (default: test_gdn_gpu, test_sample_gpu and test_hyper_gpu in
#                 tests/kernels; PYTEST_FILES=tests runs the whole GPU suite, the README's command)
#   restore       a verify round's lane restores one at a time against the pool's one launch, host and GPU time
#                 and bits at 1, 8 and 64 lanes (`bench_restore.py`)
#   forward       the kernel path's greedy tokens against the CPU reference, and rows, windows and restores
#                 batched against alone, on the shipped model (`gpu_forward_check.py --models shipped --reps 1`)
#   hyper         the hyper-connection reads' errors, rows and times at 1 to 1,024 rows (`gpu_check_hyper.py`)
#   moe           with BEFORE: the routed MoE's bits and time against BEFORE's (`gpu_ab_moe.py`); then its tiles swept
#                 at MOE_ROWS (default 1 4) over 4 warps and 3 or 4 stages (`gpu_sweep_moe.py`)
#   step          rank 0's half of a round alone, 1 and 64 lanes, replayed (`gpu_step_profile.py --alone-as 2`)
#   prompt        prompt graphs against eager at the real shapes, with the capture's memory (`gpu_prompt_graphs.py`)
#   draws         the greedy draws' bits and times (`gpu_check_router_sample.py --only sample --mix greedy`)
#   graphs        the trunk graphs against eager (`gpu_graph_check.py`)
#   serve         the shipped model at --tp 1 with CUDA graphs and MTP drafts (every graph kind), checked by eval_small:
#                 drafted = "draft": false by token_sha, concurrent = solo at 1 and 8 streams
#   resume        the shipped model with a prompt budget of 128 and the cache on: a 700-token prompt cold (passes cut
#                 by the budget, GDN's whole chunks), then resumed twice and by 4 concurrent streams, all with the
#                 cold request's token_sha (`bench_cache.py`)
#   frontend      the shipped model at --tp 1: rank 0's rounds with no HTTP against FRONTEND_CLIENTS (default 64)
#                 streaming clients of FRONTEND_TOKENS tokens (default 128), for each front end in FRONTENDS
#                 (default "process thread process"; `bench_frontend.py`), with FRONTEND_FLAGS for the server
# With BEFORE set to another tree's folder, `hyper`, `step`, `prompt` and `draws` run there too (an A/B).
# Usage, from the repo root there (carry .whl and build/small/data):  bash scripts/gpu_single.sh  # logs under $OUT
# The logs are packed at the end into $OUT/gpu_single_HHMMSS.tgz (`pack_out`; PACK=0 leaves them as they are).
set -u
: "${OUT:?set OUT to the folder for logs}"
source scripts/gpu_serve.sh
checks=" ${CHECKS:-pytest restore forward hyper moe step prompt draws graphs serve resume frontend} "
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader

both() {  # name, limit, script and flags: run in this tree, and in BEFORE when set
  local name=$1 limit=$2
  shift 2
  timeout "$limit" python3 "$@" --out "$OUT/$name" > "$OUT/$name.out" 2>&1
  echo "$name rc=$? $(since)"; grep -v "it/s\]\|tensor/s\]\|^ " "$OUT/$name.out" | tail -12
  if [ -n "${BEFORE:-}" ]; then
    (cd "$BEFORE" && PYTHONPATH=/tmp/site:. timeout "$limit" python3 "$@" --out "$OUT/${name}_before") \
      > "$OUT/${name}_before.out" 2>&1
    echo "$name in $BEFORE rc=$? $(since)"; grep -v "it/s\]\|tensor/s\]\|^ " "$OUT/${name}_before.out" | tail -12
  fi
}

if [[ $checks == *" pytest "* ]]; then
  # shellcheck disable=SC2086
  TRITON_INTERPRET=0 timeout 300 python3 -m pytest -q -m gpu \
    ${PYTEST_FILES:-tests/kernels/test_gdn_gpu.py tests/kernels/test_sample_gpu.py tests/kernels/test_hyper_gpu.py} \
    > "$OUT/pytest_gpu.out" 2>&1
  echo "pytest -m gpu rc=$? $(since)"; tail -2 "$OUT/pytest_gpu.out"
fi
if [[ $checks == *" restore "* ]]; then
  timeout 240 python3 scripts/bench_restore.py --lanes 1 8 64 --json "$OUT/restore.json" > "$OUT/restore.out" 2>&1
  echo "restore rc=$? $(since)"; tail -4 "$OUT/restore.out"
fi
if [[ $checks == *" forward "* ]]; then
  timeout 300 python3 scripts/gpu_forward_check.py --out "$OUT/forward" --models shipped --reps 1 \
    > "$OUT/forward.out" 2>&1
  echo "forward check rc=$? $(since)"; grep -i "fail\|error" "$OUT/forward.out" | tail -6
fi
[[ $checks == *" hyper "* ]] && both hyper 150 scripts/gpu_check_hyper.py --only read read_mixer \
  --batches 1 8 64 256 1024
if [[ $checks == *" moe "* ]]; then
  if [ -n "${BEFORE:-}" ]; then
    timeout 200 python3 scripts/gpu_ab_moe.py --before "$BEFORE/kernels/moe.py" --rows 1 2 4 7 8 64 \
      > "$OUT/ab_moe.out" 2>&1
    echo "moe A/B rc=$? $(since)"; tail -8 "$OUT/ab_moe.out"
  fi
  # shellcheck disable=SC2086
  timeout 240 python3 scripts/gpu_sweep_moe.py --out "$OUT/moe_sweep" --rows ${MOE_ROWS:-1 4} --warps 4 \
    --stages 3 4 > "$OUT/moe_sweep.out" 2>&1
  echo "moe sweep rc=$? $(since)"; grep -v "^  best [2-5]" "$OUT/moe_sweep.out" | tail -24
fi
[[ $checks == *" step "* ]] && both step 200 scripts/gpu_step_profile.py --alone-as 2 --lanes 1 64 --rounds 10 \
  --random-tokens 120000
[[ $checks == *" prompt "* ]] && both prompt_graphs 240 scripts/gpu_prompt_graphs.py
[[ $checks == *" draws "* ]] && both draws 200 scripts/gpu_check_router_sample.py --only sample --mix greedy
if [[ $checks == *" graphs "* ]]; then
  timeout 200 python3 scripts/gpu_graph_check.py --out "$OUT" > "$OUT/graph_check.out" 2>&1
  echo "graph check rc=$? $(since)"; tail -4 "$OUT/graph_check.out"
fi
if [[ $checks == *" serve "* ]]; then
  port=8600
  serve_until_up 200 $port "$OUT/serve_tp1.log" --tp 1 --device cuda --cuda-graphs on --drafter mtp && up=1 || up=0
  echo "shipped model at --tp 1 up=$up $(since)"
  grep "lane pool\|CUDA graphs" "$OUT/serve_tp1.log" | head -3
  if [ $up = 1 ]; then
    timeout 200 python3 scripts/eval_small.py serve --data build/small/data --base-url "http://127.0.0.1:$port" \
      --prompts 6 --tokens 48 --streams 1,8 --json "$OUT/eval_tp1.json" 2>&1 | tail -8
    echo "eval rc=${PIPESTATUS[0]} $(since)"
  fi
  stop_server
  grep -i "error\|Traceback" "$OUT/serve_tp1.log" | head -5
fi
if [[ $checks == *" resume "* ]]; then
  port=8601
  serve_until_up 200 $port "$OUT/serve_resume.log" --tp 1 --device cuda --cuda-graphs on --prompt-budget 128 \
    --prompt-cache-grid 200 && up=1 || up=0
  echo "shipped model, prompt budget 128, up=$up $(since)"
  if [ $up = 1 ]; then
    timeout 200 python3 scripts/bench_cache.py --base-url "http://127.0.0.1:$port" --random-prompt 700 --vocab 4000 \
      --tokens 24 --repeats 2 --streams 4 --require-cold --require-reuse --json "$OUT/resume.json" 2>&1 | tail -8
    echo "resume rc=${PIPESTATUS[0]} $(since)"
  fi
  stop_server
  grep -i "error\|Traceback" "$OUT/serve_resume.log" | head -5
fi
if [[ $checks == *" frontend "* ]]; then
  run=0
  for frontend in ${FRONTENDS:-process thread process}; do
    run=$((run + 1))
    timeout 400 python3 scripts/bench_frontend.py --device cuda --clients "${FRONTEND_CLIENTS:-64}" --max-tokens "${FRONTEND_TOKENS:-128}" \
      --prompt-tokens 64 --frontend "$frontend" ${FRONTEND_FLAGS:-} --json "$OUT/frontend_${run}_$frontend.json" > "$OUT/frontend_${run}_$frontend.out" 2>&1
    echo "front end $frontend rc=$? $(since)"; tail -10 "$OUT/frontend_${run}_$frontend.out"
  done
fi
if [ "${PACK:-1}" = 1 ]; then
  source scripts/gpu_pack.sh
  pack=gpu_single_$(date +%H%M%S)
  pack_out "$pack" && echo "logs packed into $OUT/$pack.tgz"
fi
