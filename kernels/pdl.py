"""Programmatic dependent launch (PDL): a kernel's blocks start while the kernel before it in the stream finishes.

Every Triton kernel of the forward takes a `PDL` constexpr and calls `enter(PDL)` before it touches memory that an
earlier kernel writes or reads: it waits there until the previous kernel has finished and its writes are visible,
then lets the next kernel launch. So the order of every memory access is the order without PDL (and a kernel that
waited for its predecessor has also waited for everything before that), and the bits are the same; what overlaps is
the launch, the blocks' start-up, the reads of weights no kernel writes (`load_unwritten`: the hyper read's norm
weight; `prefetch_l2`: the linear kernel's and the up kernel's weights, into L2) and of memory that neither the
kernel just before nor one on a stream joined just before writes (`load_settled`: GDN's recurrent states in its
decode step, the router's ids and weights in the one-row MoE's down, and those with the shared expert's output and
logit in the grouped MoE's combine). Launches pass
`**launch_options(kernel, device)`: PDL on Hopper or later unless `FLASHNEXT_PDL=0`; never under the interpreter.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
PDL_ENV = "FLASHNEXT_PDL"
PREFETCH_ENV = "FLASHNEXT_PDL_PREFETCH"


@triton.jit
def enter(PDL: tl.constexpr):
    """Wait for the previous kernel's writes, then let the next kernel launch (nothing without PDL)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def load_unwritten(ptrs, mask, other):
    """A load of memory that no kernel writes (weights), which a kernel may issue before `enter`, while the previous
    kernel runs."""
    return tl.load(ptrs, mask=mask, other=other)


@triton.jit
def load_settled(ptrs, mask, other):
    """A load, issued before `enter`, of memory that neither the kernel just before in the stream nor one on a stream
    joined just before writes: those are the only kernels still running then, since each waits for everything
    before it before the next kernel may launch. Cached in L2 only, so no line an earlier kernel left in L1 is read."""
    return tl.load(ptrs, mask=mask, other=other, cache_modifier=".cg")


@triton.jit
def prefetch_l2(ptrs):
    """Hint L2 to fetch the lines at `ptrs` (valid addresses); nothing is read into registers."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
    )


@functools.cache
def _hopper_or_later(index: int) -> bool:
    """Whether CUDA device `index` has grid dependency control (compute capability 9.0 or later)."""
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    """PDL for launches on `device`: CUDA, Hopper or later, not the interpreter, and `FLASHNEXT_PDL` not 0."""
    if INTERPRET or device.type != "cuda" or os.environ.get(PDL_ENV, "1") == "0":
        return False
    return _hopper_or_later(device.index if device.index is not None else torch.cuda.current_device())


def prefetch_enabled(device: torch.device) -> bool:
    """Weight prefetch before the wait (linear and up kernels): with PDL, unless `FLASHNEXT_PDL_PREFETCH` is 0."""
    return pdl_enabled(device) and os.environ.get(PREFETCH_ENV, "1") != "0"


def launch_options(kernel: triton.runtime.JITFunction, device: torch.device) -> dict[str, bool]:
    """`PDL` and `launch_pdl` for one launch of `kernel`, which must take the `PDL` constexpr (so it calls enter)."""
    if "PDL" not in kernel.arg_names:
        raise TypeError(f"{kernel.fn.__name__} takes no PDL constexpr: it cannot be launched as a dependent")
    on = pdl_enabled(device)
    return {"PDL": on, "launch_pdl": on}
