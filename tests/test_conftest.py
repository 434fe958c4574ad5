"""The test setup: its refusal of a GPU run that would only interpret kernels, and its interpreted fp32 dots."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
import triton
import triton.language as tl

from tests.conftest import interpreter_trap


def test_a_gpu_run_without_compiled_kernels_is_refused() -> None:
    assert "TRITON_INTERPRET=0" in interpreter_trap("gpu", cuda=True, given=None)
    assert interpreter_trap("gpu", cuda=True, given="1")
    assert interpreter_trap("gpu", cuda=True, given="0") is None
    assert interpreter_trap("gpu", cuda=False, given=None) is None  # no CUDA: the GPU tests skip as they should
    assert interpreter_trap("", cuda=True, given=None) is None  # the whole suite on a GPU machine: mixed, as in CI


@triton.jit
def _dot_kernel(a_ptr, b_ptr, out_ptr, N: tl.constexpr):
    """out = 0.5 + a·b for one [N, N] tile of fp32."""
    offs = tl.arange(0, N)[:, None] * N + tl.arange(0, N)[None, :]
    acc = tl.full((N, N), 0.5, tl.float32)
    tl.store(out_ptr + offs, tl.dot(tl.load(a_ptr + offs), tl.load(b_ptr + offs), acc, input_precision="ieee"))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter's dots only")
def test_an_interpreted_fp32_dot_rounds_its_sum_once() -> None:
    """Each row of `a` holds 1, 2^24 and -2^24 (in two orders, at every place): its sum is 1 exactly, and 0 or 1
    in fp32 as the machine's BLAS orders it (OpenBLAS's Haswell kernels give 0 for half of these rows)."""
    a = torch.zeros(16, 16)
    for r in range(16):
        values = [1.0, -(2.0**24), 2.0**24] if r % 2 == 0 else [1.0, 2.0**24, -(2.0**24)]
        a[r, [r, (r + 1) % 16, (r + 2) % 16]] = torch.tensor(values)
    out = torch.empty(16, 16)
    _dot_kernel[(1,)](a, torch.ones(16, 16), out, N=16)
    assert out.eq(1.5).all()
