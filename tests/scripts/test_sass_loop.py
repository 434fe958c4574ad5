"""scripts/sass_loop.py's loop finder on a hand-written SASS listing (compiling needs no GPU but takes a while)."""

from __future__ import annotations

import sass_loop

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
