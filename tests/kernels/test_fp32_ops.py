"""The kernels' fp32 helpers: `negative_zeros` gives -0.0 under the interpreter and compiled for sm_90 (in a
subprocess, without the interpreter); no kernel asks `tl.full` for -0.0, which Triton 3.6 (the GPU machine's)
compiles to +0.0."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"

import torch
import triton
import triton.language as tl

from kernels.fp32_ops import negative_zeros

ROOT = Path(__file__).resolve().parents[2]

COMPILED = r"""
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.fp32_ops import negative_zeros

@triton.jit
def store(out_ptr, B: tl.constexpr):
    tl.store(out_ptr + tl.arange(0, B), negative_zeros((B,)))

source = ASTSource(store, {"out_ptr": "*fp32", "B": "constexpr"}, constexprs={(1,): 32})
print(triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1}).asm["ptx"])
"""


@triton.jit
def _store_negative_zeros(out_ptr, B: tl.constexpr, C: tl.constexpr):
    offs = tl.arange(0, B)[:, None] * C + tl.arange(0, C)[None, :]
    tl.store(out_ptr + offs, negative_zeros((B, C)))


def test_negative_zeros_are_negative_under_the_interpreter() -> None:
    out = torch.ones(4, 8)
    _store_negative_zeros[(1,)](out, B=4, C=8)
    assert (out == 0).all() and torch.signbit(out).all()


def test_negative_zeros_compile_to_the_bits_of_negative_zero(tmp_path: Path) -> None:
    script = tmp_path / "compile_negative_zeros.py"  # a file: Triton reads a kernel's source from it
    script.write_text(COMPILED)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    stored = re.findall(r"st\.global\.b32 \[ %rd\d+ \+ 0 \], \{ (%r\d+) \};", run.stdout)
    assert stored, run.stdout[-2000:]
    values = {reg: value for reg, value in re.findall(r"mov\.b32 \s*(%r\d+), (\S+);", run.stdout)}
    assert {values.get(reg) for reg in stored} <= {"-2147483648", "0f80000000"}, run.stdout[-2000:]


def test_no_kernel_asks_tl_full_for_a_negative_zero() -> None:
    """Triton up to 3.6 takes any value equal to zero for its null constant, so `tl.full(shape, -0.0, ...)` compiles
    to +0.0 there (the interpreter and later Tritons keep -0.0): the kernels take `negative_zeros` instead."""
    asked = [
        f"{path.name}:{number}"
        for path in sorted((ROOT / "kernels").glob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"tl\.full\(.*,\s*-0\.0\s*,\s*(dtype=)?tl\.\w+\)", line)
    ]
    assert not asked, asked
