"""The routed MoE's Triton kernels compiled for sm_90 on this machine (no GPU needed), at the tiles `moe_tiles` picks
for ROWS rows and the real per-rank shapes, as `moe_forward` launches them (the pairs path's kernels at one row):
instructions in one K step (its bundled nvdisasm lists the SASS; the K loop is the body of the longest backward
branch) and the k width of every dot's operands (`kWidth` in the Triton GPU IR). The width decides which k terms one
tensor-core step adds, so every kernel must keep kernels/moe_gluon.py's (MMA_K_WIDTH) for the paths to give the same
bits. Counts and widths depend on the Triton version.

python3 scripts/sass_loop.py [--rows 1 8 64 1024] [--module FILE]   # FILE: another copy of kernels/moe.py
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

ROWS = (1, 8, 64, 1024)
SHAPE = {"E": 512, "TOP_K": 10, "D": 2560, "INTER": 320}  # experts, top-k and per-rank widths of the real model
POINTERS = {"x_ptr": "*bf16", "h_ptr": "*bf16", "s_ptr": "*fp8e4nv", "s2_ptr": "*fp32", "y_ptr": "*fp32",
            "wts_ptr": "*fp32", "out_ptr": "*bf16", "shared_ptr": "*bf16", "logit_ptr": "*bf16"}  # fmt: skip
ADDRESS = re.compile(r"/\*([0-9a-f]{4,})\*/")
BRANCH = re.compile(r"BRA\s+`?\(?(\.L_x_\d+)")
K_WIDTH = re.compile(r"dot_op<\{opIdx = \d+, parent = #[\w.]+, kWidth = (\d+)\}>")
DOT = re.compile(r"= tt\.dot ")


def load_module(path: Path | None) -> ModuleType:
    """kernels/moe.py of this tree, or another copy of it."""
    if path is None:
        from kernels import moe

        return moe
    spec = importlib.util.spec_from_file_location("moe_copy", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def signature(kernel: triton.runtime.JITFunction) -> dict[str, str]:
    """Each runtime argument's Triton type: ids and FP4 codes read as int32 words, ints as i32."""
    return {name: POINTERS.get(name, "*i32") if name.endswith("_ptr") else "i32" for name in kernel.arg_names}


def loop_length(sass: str) -> int:
    """Instructions from the target of the longest backward branch through the branch itself."""
    labels, best, address = {}, 0, None
    for line in sass.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = None  # the next instruction's address
            continue
        found = ADDRESS.search(line)
        if not found:
            continue
        address = int(found.group(1), 16)
        for name, at in labels.items():
            if at is None:
                labels[name] = address
        branch = BRANCH.search(line)
        if branch and labels.get(branch.group(1)) is not None and labels[branch.group(1)] <= address:
            best = max(best, (address - labels[branch.group(1)]) // 16 + 1)
    return best


def kernel_names(module: ModuleType, rows: int) -> tuple[str, str]:
    """The gate-up and down kernels `moe_forward` launches for `rows` rows (the Triton ones of the grouped path)."""
    return ("gate_up_pairs", "down_pairs") if rows < module.PAIR_ROWS else ("gate_up", "down")


def compile_kernel(module: ModuleType, name: str, rows: int) -> object:
    """Kernel `name` (gate_up, down, gate_up_pairs or down_pairs) compiled for sm_90 with the constants and launch
    options `moe_forward` gives it for `rows` rows of an NVFP4 bank (bf16 output, the gated shared expert)."""
    tiles = module.moe_tiles(rows, SHAPE["TOP_K"], SHAPE["E"])
    kernel = getattr(module, f"_{name}_kernel")
    if name.startswith("gate_up"):
        block_n, (block_k, span) = tiles.gate_up_n, module._k_tile(tiles.gate_up_k, True, SHAPE["D"])
        even_k = SHAPE["D"] % block_k == 0
    else:
        block_n, (block_k, span) = tiles.down_n, module._k_tile(tiles.down_k, True, SHAPE["INTER"])
        even_k = SHAPE["INTER"] % block_k == 0
    constexprs = {"E": SHAPE["E"], "TOP_K": SHAPE["TOP_K"], "K_POW2": triton.next_power_of_2(SHAPE["TOP_K"]),
                  "BLOCK_M": tiles.block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP": tiles.down_group,
                  "EVEN_K": even_k, "FP4": True, "OUT_BF16": True, "GATED": True, "INTERPRET": False, "PDL": True,
                  "SPAN": span}  # fmt: skip
    constexprs = {k: v for k, v in constexprs.items() if k in kernel.arg_names}
    types = {k: v for k, v in signature(kernel).items() if k not in constexprs}
    attrs = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(kernel.arg_names) if arg in types}
    source = ASTSource(kernel, {**types, **dict.fromkeys(constexprs, "constexpr")}, constexprs, attrs)
    options = {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def count(compiled: object) -> int:
    """Instructions in the K loop of a compiled kernel."""
    disasm = Path(triton.__file__).parent / "backends/nvidia/bin/nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        sass = subprocess.run([str(disasm), "-c", cubin.name], capture_output=True, text=True, check=True).stdout
    return loop_length(sass)


def k_widths(ttgir: str) -> list[int]:
    """The k width of both operands of every dot in a kernel's Triton GPU IR, in order."""
    return [int(w) for line in ttgir.splitlines() if DOT.search(line) for w in K_WIDTH.findall(line)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=list(ROWS), help=f"row counts (default {list(ROWS)})")
    ap.add_argument("--module", type=Path, help="another copy of kernels/moe.py (default: this tree's)")
    args = ap.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)  # kernels defined from here on compile; the interpreter's cannot
    module = load_module(args.module)
    print(f"Triton {triton.__version__}, sm_90, {args.module or 'kernels/moe.py'}: K-loop instructions (dot k widths)")
    for rows in args.rows:
        parts = []
        for name in kernel_names(module, rows):
            compiled = compile_kernel(module, name, rows)
            parts.append(f"{name} {count(compiled)} ({','.join(map(str, k_widths(compiled.asm['ttgir'])))})")
        print(f"rows {rows:5d}  " + "  ".join(parts), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
