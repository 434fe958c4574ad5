#!/usr/bin/env bash
# A round's host time before its graph launch, this tree against BEFORE's (another tree's folder), at the real shapes
# (rank 0's half alone, `--max-lanes 8 --prompt-budget 256`): ROUNDS (default 2) times, alternating the trees, one
# traced stream in turn (gpu_plan_trace.sh, PROFILE=0: the trace's phases and Python's profile); then each tree
# untraced, one stream in turn and planned ahead, 3 reps (gpu_plan_ahead.sh), their token_sha compared across modes
# and trees; then this tree's drafting rounds traced.
# Both trees run this tree's harness scripts. Logs under $OUT.
# Usage, from the repo root there (carry .whl and BEFORE):  BEFORE=build/before bash scripts/gpu_host_ab.sh
set -u
: "${OUT:?set OUT to the folder for logs}" "${BEFORE:?set BEFORE to the other tree folder}"
cp -r .whl "$BEFORE/" && cp scripts/gpu_plan_trace.sh scripts/gpu_plan_ahead.sh scripts/gpu_serve.sh scripts/same_tokens.py \
  "$BEFORE/scripts/"
here=$PWD
real=(MODEL=real TOKENS=64 VOCAB=200000 SERVE_S=200 "SERVE_ARGS=--max-lanes 8 --prompt-budget 256")
tree_dir() { if [ "$1" = before ]; then echo "$BEFORE"; else echo "$here"; fi; }
key='^T=0 .*N=1:|^lanes=1 rows=1|^  GPU stream|\((replay|ngram_windows|to_device|forward|launch|run)\)$'
for n in $(seq 1 "${ROUNDS:-2}"); do
  for tree in after before; do
    log=$OUT/trace_$tree$n.log
    (cd "$(tree_dir $tree)" && env "${real[@]}" PROFILE=0 MODES=off OUT="$OUT" timeout 200 \
      bash scripts/gpu_plan_trace.sh > "$log" 2>&1; mv "$OUT/trace_real_off" "$OUT/trace_$tree$n")
    grep -E "$key" "$log" | sed "s/^/$tree$n /"
  done
done
for tree in after before; do
  mkdir -p "$OUT/speed_$tree"
  (cd "$(tree_dir $tree)" && env "${real[@]}" MODES="off on" LEVELS=1 REPS=3 OUT="$OUT/speed_$tree" timeout 200 \
    bash scripts/gpu_plan_ahead.sh > "$OUT/speed_$tree.log" 2>&1)
  grep -E "streams: " "$OUT/speed_$tree.log" | sed "s/^/$tree /"
  mkdir -p "$OUT/speed_both"
  for out in "$OUT/speed_$tree"/*.out; do cp "$out" "$OUT/speed_both/${tree}_$(basename "$out")"; done
done
python3 scripts/same_tokens.py "$OUT/speed_both" --what "modes and trees"
env "${real[@]}" PROFILE=0 MODES=off DRAFTS=on OUT="$OUT" timeout 200 bash scripts/gpu_plan_trace.sh \
  > "$OUT/trace_drafted.log" 2>&1
grep -E "^T=0|^lanes=|^  GPU stream|\((replay|ngram_windows|to_device|forward|launch|run)\)$" "$OUT/trace_drafted.log" \
  | sed "s/^/drafted /" | head -40
