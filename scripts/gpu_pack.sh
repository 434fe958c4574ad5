#!/usr/bin/env bash
# `pack_out NAME`: everything under $OUT but earlier packs (*.tgz) into $OUT/NAME.tgz, removed from $OUT, so that a
# call's outputs come back as one file (a device call returns at most eight files, two folders down).
# Usage, from a GPU script:  source scripts/gpu_pack.sh; pack_out gpu_single_1
pack_out() {
  (cd "${OUT:?set OUT to the folder for logs}" \
    && find . -mindepth 1 -maxdepth 1 ! -name '*.tgz' -printf '%P\0' | tar -czf "$1.tgz" --null -T - --remove-files)
}
