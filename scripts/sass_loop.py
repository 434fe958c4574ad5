"""Instructions in one K step of the routed MoE's kernels, compiled for sm_90 on this machine (no GPU needed): Triton
compiles the kernel for GPUTarget("cuda", 90, 32) at the tiles `moe_tiles` picks for ROWS rows, its bundled nvdisasm
lists the SASS, and the K loop is the body of the longest backward branch. Counts depend on the Triton version.

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
SHAPE = {"E": 512, "TOP_K": 10}  # experts and top-k of the real model
POINTERS = {"x_ptr": "*bf16", "h_ptr": "*bf16", "s_ptr": "*fp8e4nv", "s2_ptr": "*fp32", "y_ptr": "*fp32"}
ADDRESS = re.compile(r"/\*([0-9a-f]{4,})\*/")
BRANCH = re.compile(r"BRA\s+`?\(?(\.L_x_\d+)")


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


def count(module: ModuleType, name: str, rows: int) -> int:
    """K-loop instructions of kernel `name` (gate_up or down) at the tiles for `rows` rows."""
    tiles = module.moe_tiles(rows, SHAPE["TOP_K"], SHAPE["E"])
    kernel = getattr(module, f"_{name}_kernel")
    constexprs = {"E": SHAPE["E"], "BLOCK_M": tiles.block_m, "EVEN_K": True, "FP4": True, "INTERPRET": False}
    if name == "gate_up":
        constexprs |= {"TOP_K": SHAPE["TOP_K"], "BLOCK_N": tiles.gate_up_n, "BLOCK_K": tiles.gate_up_k}
    else:
        constexprs |= {"BLOCK_N": tiles.down_n, "BLOCK_K": tiles.down_k, "GROUP": getattr(tiles, "down_group", 1)}
    constexprs = {k: v for k, v in constexprs.items() if k in kernel.arg_names} | (
        {"PDL": True} if "PDL" in kernel.arg_names else {}
    )
    types = {k: v for k, v in signature(kernel).items() if k not in constexprs}
    attrs = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(kernel.arg_names) if arg in types}
    source = ASTSource(kernel, {**types, **dict.fromkeys(constexprs, "constexpr")}, constexprs, attrs)
    options = {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages}
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    disasm = Path(triton.__file__).parent / "backends/nvidia/bin/nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        sass = subprocess.run([str(disasm), "-c", cubin.name], capture_output=True, text=True, check=True).stdout
    return loop_length(sass)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=list(ROWS), help=f"row counts (default {list(ROWS)})")
    ap.add_argument("--module", type=Path, help="another copy of kernels/moe.py (default: this tree's)")
    args = ap.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)  # kernels defined from here on compile; the interpreter's cannot
    module = load_module(args.module)
    print(f"Triton {triton.__version__}, sm_90, {args.module or 'kernels/moe.py'}")
    for rows in args.rows:
        print(f"rows {rows:5d}  " + "  ".join(f"{k} {count(module, k, rows)}" for k in ("gate_up", "down")), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
