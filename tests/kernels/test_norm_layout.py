"""A zc norm program of few pairs (`kernels.norm.layout_rows`) lays each pair's lanes out as a whole tile does, so
its sums have a whole tile's bits: the zc norm and norm + RoPE kernels compiled for sm_90 (in a subprocess, without
the interpreter) at both tile sizes have the same blocked layouts. The GPU tests compare the bits themselves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kernels.norm import block_r, layout_rows

ROOT = Path(__file__).resolve().parents[2]
WIDTHS = (128, 256)  # the indexer's and the attention heads' widths

LAYOUTS = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import norm, rope

INTS = {"pos_ptr", "slot_ptr", "index_ptr"}

def layouts(kernel, rows, c):
    sig, const = {}, {"ACT_BF16": True, "BLOCK_R": rows, "BLOCK_C": c, "INTERPRET": False, "PDL": False,
                      "SCATTER": True, "BLOCK_HALF": 32}
    for p in kernel.params:
        if p.is_constexpr:
            sig[p.name] = "constexpr"
        elif p.name.endswith("_ptr"):
            sig[p.name] = "*i64" if p.name in INTS else "*fp32" if p.name == "inv_ptr" else "*bf16"
        else:
            sig[p.name] = "fp32" if p.name == "eps" else "i32"
    names = list(sig)
    consts = {(names.index(n),): v for n, v in const.items() if n in sig}
    compiled = triton.compile(ASTSource(kernel, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": norm.NUM_WARPS})
    return sorted(set(re.findall(r"#ttg\.blocked<\{[^}]*\}>", compiled.asm["ttgir"])))

out = {}
for name, kernel in (("zc_norm", norm._zc_norm_kernel), ("norm_rope", rope._norm_rope_kernel)):
    for c in map(int, sys.argv[1:]):
        out[f"{name} {c}"] = [layouts(kernel, rows, c) for rows in (norm.layout_rows(c), norm.block_r(c))]
print(json.dumps(out))
"""


def test_few_pair_tiles_have_the_whole_tiles_layouts() -> None:
    assert all(layout_rows(c) < block_r(c) for c in WIDTHS)  # the two tiles differ, so the comparison means something
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-c", LAYOUTS, *map(str, WIDTHS)], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-2000:]
    for case, (few, whole) in json.loads(run.stdout).items():
        assert few and few == whole, case
