"""A zc norm program of few pairs (`kernels.norm.small_tile_rows`) lays each pair's reduction out as a whole tile
does, so its sums have a whole tile's bits: the zc norm and norm + RoPE kernels compiled for sm_90 (in a subprocess,
without the interpreter) at both tile sizes reduce over operands of the same layouts. The GPU tests compare the bits
themselves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kernels.norm import block_r, small_tile_rows

ROOT = Path(__file__).resolve().parents[2]
WIDTHS = (64, 128, 256)  # the shipped model's heads, the indexer's and the attention heads' widths

REDUCTIONS = r"""
import json, re, sys
from triton._C.libtriton import ir
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend
from kernels import norm, rope

TARGET = GPUTarget("cuda", 90, 32)
BACKEND = make_backend(TARGET)

def ttgir(source):  # the TritonGPU IR for sm_90: the compiler's stages up to the layouts, no code generation
    options = BACKEND.parse_options({"num_warps": norm.NUM_WARPS})
    context = ir.context()
    ir.load_dialects(context)
    BACKEND.load_dialects(context)
    module = source.make_ir(TARGET, options, BACKEND.get_codegen_implementation(options), BACKEND.get_module_map(),
                            context)
    stages = {}
    BACKEND.add_stages(stages, options, source.language)
    metadata = {"hash": "layouts", "target": TARGET, **options.__dict__}
    for stage in ("ttir", "ttgir"):
        module = stages[stage](module, metadata)
    return str(module)

INTS = {"pos_ptr", "slot_ptr", "index_ptr"}

def reductions(kernel, rows, c, bf16):
    sig, const = {}, {"ACT_BF16": bf16, "BLOCK_R": rows, "BLOCK_C": norm.block_c(c), "INTERPRET": False,
                      "PDL": False, "SCATTER": True, "BLOCK_HALF": 32}
    act = "*bf16" if bf16 else "*fp32"
    for p in kernel.params:
        if p.is_constexpr:
            sig[p.name] = "constexpr"
        elif p.name.endswith("_ptr"):
            sig[p.name] = "*i64" if p.name in INTS else "*fp32" if p.name == "inv_ptr" else act
        else:
            sig[p.name] = "fp32" if p.name == "eps" else "i32"
    names = list(sig)
    consts = {(names.index(n),): v for n, v in const.items() if n in sig}
    text = ttgir(ASTSource(kernel, sig, constexprs=consts))
    named = dict(re.findall(r"^(#\w+) = (#ttg\.blocked<\{[^}]*\}>)", text, re.M))
    operands = re.findall(r'"tt\.reduce".*?\}\)\s*:\s*\(tensor<[^,>]*,\s*([^>]*)>\)', text, re.S)
    return [named.get(layout.strip(), layout.strip()) for layout in operands]

out = {}
for name, kernel in (("zc_norm", norm._zc_norm_kernel), ("norm_rope", rope._norm_rope_kernel)):
    for c in map(int, sys.argv[1:]):
        for bf16 in (True, False):
            rows = (norm.small_tile_rows(c), norm.block_r(c))
            out[f"{name} {c} {'bf16' if bf16 else 'fp32'}"] = [reductions(kernel, r, c, bf16) for r in rows]
print(json.dumps(out))
"""


def test_few_pair_tiles_reduce_as_whole_tiles_do() -> None:
    assert all(small_tile_rows(c) < block_r(c) for c in WIDTHS)  # the tiles differ, so the comparison means something
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-c", REDUCTIONS, *map(str, WIDTHS)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    for case, (few, whole) in json.loads(run.stdout).items():
        assert few and few == whole, case
