"""K-loop instructions a warp a step of kernels/moe_gluon.py's pairs gate-up forms (a: weights the MMA's first
operand; b: its second) and of its grouped gate-up, compiled for sm_90 on this machine (no GPU needed).

python3 scripts/sass_gluon_pairs.py [--warps 2]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]
os.environ.pop("TRITON_INTERPRET", None)  # kernels defined from here on compile

import triton  # noqa: E402
from sass_loop import count  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from kernels import moe_gluon  # noqa: E402

POINTERS = {"x_ptr": "*bf16", "h_ptr": "*bf16", "s_ptr": "*fp8e4nv", "s2_ptr": "*fp32", "y_ptr": "*fp32"}


def build(kernel: object, constexprs: dict[str, object], warps: int) -> object:
    """`kernel` compiled for sm_90 with these constants (pointers as their roles, ints as i32)."""
    names = kernel.arg_names
    types = {n: POINTERS.get(n, "*i32") if n.endswith("_ptr") else "i32" for n in names if n not in constexprs}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in types and n != "num_programs"}
    source = GluonASTSource(kernel, {**types, **dict.fromkeys(constexprs, "constexpr")}, constexprs, attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


def resources(compiled: object) -> str:
    """A compiled kernel's registers and spill stores a thread, as cuobjdump reports them."""
    tool = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        out = subprocess.run([str(tool), "-res-usage", cubin.name], capture_output=True, text=True, check=True).stdout
    return " ".join(re.findall(r"(REG:\d+|STACK:\d+)", out))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warps", type=int, default=2, help="the pairs forms' warps")
    warps = ap.parse_args(argv).warps
    g, block_k = moe_gluon, moe_gluon.GATE_UP_SPAN * moe_gluon.GATE_UP_SPANS
    common = {"TOP_K": 10, "SPAN": g.GATE_UP_SPAN, "BLOCK_K": block_k, "PDL": True}
    form_a = {**common, "K_POW2": 16, "WARPS": warps, "ROWS": 8, **g._layouts(g.GATE_UP_SPAN, block_k, warps, 8),
              **g._pairs_layouts(warps, 8)}  # fmt: skip
    form_b = {**common, "K_POW2": 16, "WARPS": warps, **g._pairs_b_layouts(g.GATE_UP_SPAN, block_k, warps)}
    grouped = {**common, "E": 512, "WARPS": 2, "ROWS": 8, **g._layouts(g.GATE_UP_SPAN, block_k, 2, 8)}
    print(f"Triton {triton.__version__}, sm_90: K-loop instructions a warp a step")
    for ring in (1, 2, 5):
        a = build(g._gate_up_pairs_kernel, {**form_a, "RING": ring}, warps)
        print(f"pairs form a, {warps} warps, ring {ring}: {count(a)} ({resources(a)})")
    for ring in (1, 2, 5):
        b = build(g._gate_up_pairs_b_kernel, {**form_b, "RING": ring, "AHEAD": False}, warps)
        print(f"pairs form b, {warps} warps, ring {ring}: {count(b)} ({resources(b)})")
    b = build(g._gate_up_pairs_b_kernel, {**form_b, "RING": 2, "AHEAD": True}, warps)
    print(f"pairs form b, {warps} warps, ring 2, decoded ahead: {count(b)} ({resources(b)})")
    print(f"grouped gate-up, 2 warps: {count(build(g._gate_up_kernel, grouped, 2))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
