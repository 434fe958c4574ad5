"""scripts/sass_loop.py's loop finder on a hand-written SASS listing, its k widths on a hand-written IR line, and the
MoE kernels' k widths as it compiles them for sm_90 (no GPU needed)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import sass_loop

from kernels.moe_gluon import MMA_K_WIDTH

SCRIPT = Path(sass_loop.__file__)
DOT_LINE = (
    "%acc = tt.dot %a, %b, %c, inputPrecision = tf32 : tensor<16x64xbf16, #ttg.dot_op<{opIdx = 0, parent = #mma, "
    "kWidth = 8}>> * tensor<64x64xbf16, #ttg.dot_op<{opIdx = 1, parent = #mma, kWidth = 4}>> -> tensor<16x64xf32, #mma>"
)

LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/              @!P0 BRA `(.L_x_0) ;
.L_x_1:
        /*0020*/                   LDS R2, [R3] ;
        /*0030*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0040*/                   IADD3 R5, R5, 0x1, RZ ;
        /*0050*/              @!P1 BRA `(.L_x_1) ;
.L_x_2:
        /*0060*/                   NOP ;
        /*0070*/              @P2 BRA `(.L_x_2) ;
.L_x_0:
        /*0080*/                   EXIT ;
"""


def test_the_loop_is_the_longest_backward_branch_body() -> None:
    assert sass_loop.loop_length(LISTING) == 4  # 0x20 through the branch at 0x50; not the forward branch to .L_x_0


def test_no_backward_branch_is_no_loop() -> None:
    assert sass_loop.loop_length(LISTING.split(".L_x_1:")[0]) == 0


def test_k_widths_are_both_operands_of_every_dot() -> None:
    other = "%x = ttg.convert_layout %y : tensor<16x64xbf16, #ttg.dot_op<{opIdx = 0, parent = #mma, kWidth = 2}>>"
    both = DOT_LINE.replace("kWidth = 4", "kWidth = 8")
    assert sass_loop.k_widths("\n".join([DOT_LINE, other, both])) == [8, 4, 8, 8]
    assert sass_loop.k_widths(other) == []


def test_every_moe_kernel_takes_the_gluon_kernels_k_width() -> None:
    """Each Triton MoE kernel `moe_forward` launches on CUDA (the pairs path's at one row; the grouped path's, at 4, 8
    and 1,024 rows, where the Gluon kernels decline), compiled for sm_90 by the installed Triton in a process without
    the interpreter, takes both operands of every dot with kernels/moe_gluon.py's k width, so that every path adds the
    same k in each tensor-core step. (A one-row down that loaded its block scales a K tile ahead compiled to width 2
    with Triton 3.9 and 4 with 3.6, and gave other bits than the grouped path on the H200.)"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--rows", "1", "4", "8", "1024"], env=env, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [line for line in run.stdout.splitlines() if line.startswith("rows")]
    kernels = [re.findall(r"(\w+) \d+ \(([\d,]+)\)", line) for line in rows]
    names = [[name for name, _ in row] for row in kernels]
    assert names == [["gate_up_pairs", "down_pairs"]] + [["gate_up", "down"]] * 3
    widths = [(name, {int(w) for w in found.split(",")}) for row in kernels for name, found in row]
    assert all(found == {MMA_K_WIDTH} for _, found in widths), widths
