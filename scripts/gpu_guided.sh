#!/usr/bin/env bash
# One GPU, the shipped model served on the kernel path with CUDA graphs and MTP drafts (`pick_model`):
# gpu_api_check.py (every API extension's exactness, guided decoding included), bench_guided.py (what a grammar costs
# a served request), then, on a fresh server, bench_draft_penalties.py (draft acceptance under penalties). Logs under
# $OUT. Run from the repo root with `.whl` carried: OUT=$OUT timeout 590 bash scripts/gpu_guided.sh
source scripts/gpu_serve.sh
pick_model
url=http://127.0.0.1:8601
serve_until_up 200 8601 "$OUT/serve.log" "${model_args[@]}" || { tail -40 "$OUT/serve.log"; exit 1; }
echo "server up $(since)"
timeout 300 python3 scripts/gpu_api_check.py --base-url $url | tee "$OUT/api_check.log"
echo "api check rc ${PIPESTATUS[0]} $(since)"
timeout 200 python3 scripts/bench_guided.py --base-url $url --requests 8 --tokens 128 --concurrency 1 8 --json \
  | tee "$OUT/bench_guided.log"
echo "bench_guided $(since)"
stop_server
serve_until_up 200 8601 "$OUT/serve_penalties.log" "${model_args[@]}" || { tail -40 "$OUT/serve_penalties.log"; exit 1; }
timeout 200 python3 scripts/bench_draft_penalties.py --base-url $url --json | tee "$OUT/draft_penalties.log"
echo "draft penalties $(since)"
stop_server
