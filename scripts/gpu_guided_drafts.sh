#!/usr/bin/env bash
# One GPU, the shipped model served on the kernel path with CUDA graphs and MTP drafts (`pick_model`): bench_guided.py
# with the regex and the JSON guide, on this tree and on BEFORE's (another tree's folder) in turn: what a guided
# lane's drafts keep and what its requests take.
# Usage, from the repo root there (carry .whl and BEFORE):  BEFORE=build/before OUT=$OUT timeout 590 bash scripts/gpu_guided_drafts.sh
# (GUIDES, default "regex json", CONCURRENCY, default "1 8", and PASSES, default 2, set the guides, levels and passes)
: "${OUT:?set OUT to the folder for logs}" "${BEFORE:?set BEFORE to the other tree folder}"
source scripts/gpu_serve.sh
pick_model
here=$PWD
url=http://127.0.0.1:8601

bench() {  # bench NAME: both guides, drafts on, against the server at $url
  for guide in ${GUIDES:-regex json}; do
    timeout 100 python3 "$here/scripts/bench_guided.py" --base-url $url --requests 8 --tokens 128 \
      --concurrency ${CONCURRENCY:-1 8} --passes ${PASSES:-2} --guide $guide --json > "$OUT/bench_${1}_$guide.log" 2>&1
    echo "bench $1 $guide rc $? $(since)"
    grep -v '^\[' "$OUT/bench_${1}_$guide.log"
  done
}

serve_until_up 200 8601 "$OUT/serve_after.log" "${model_args[@]}" || { tail -40 "$OUT/serve_after.log"; exit 1; }
echo "this tree's server up $(since)"
bench after
stop_server
cd "$BEFORE" || exit 1
serve_until_up 200 8601 "$OUT/serve_before.log" "${model_args[@]}" || { tail -40 "$OUT/serve_before.log"; exit 1; }
echo "BEFORE's server up $(since)"
bench before
stop_server
