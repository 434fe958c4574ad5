"""Two ranks' partial sums exchanged inside the kernel that consumes them, over NVLink, with no collective launch.

A `PeerSum` stands for y = act(p_0 + p_1) at two ranks: this rank holds its own fp32 partial and the peer pushes
its own into this rank's receive slot. The consuming launch (the hyper write, kernels/hyper.py) calls
`exchange_row` once per row after its PDL wait: the row's pushing program stores the row of its partial into the
peer's receive slot (`send`, a view of the peer's symmetric memory), then raises the row's flag in the peer's flags
to this call's use number (a system-scope release, after a barrier over the program's stores); every program then
waits (a system-scope acquire) until its own flag for the row has reached the use number, and reads the peer's row
from `received` (cached in L2 only). Two fp32 terms add to the same bits in either order, so both ranks get the sum
the NCCL all-reduce gave, bit for bit.

Use numbers are epoch · SITES + site: the epoch a device counter that each forward adds one to before its first
call, the site the call's place in the forward. They grow from call to call, so a flag left by an earlier call is
below the current one. The receive slots alternate by site, and a forward has an even number of sites, so calls
alternate slots: a rank pushes into a slot two calls after its last push there, having passed the peer's push of
the call between, which the peer makes only after its PDL wait, so after it has read the slot. That wait covers all
earlier work because every kernel between waits for the one before it (kernels/pdl.py), and the argument needs both
ranks to exchange at every site a forward numbers, or at none: the sites' row counts are the forward's own, so the
ranks' choices agree, and a call of no rows takes no site (model/peer_sums.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

SITES = 1024  # calls a forward may make at most: the site is a call's place in its forward
SLOTS = 2  # receive slots, used in turn by site
_SITES = tl.constexpr(SITES)  # the same, as the kernels read it


@dataclass(frozen=True, slots=True)
class PeerSum:
    """y = act(partial + the peer's partial) for an [N, d] fp32 partial of this rank: `send` is the peer's receive
    slot (peer memory) and `received` this rank's ([≥N, d] fp32 each), `flags` and `peer_flags` their rows' int64
    flags, `epoch` this rank's forward counter ([1] int64), `site` the call's place in its forward."""

    partial: torch.Tensor
    send: torch.Tensor
    received: torch.Tensor
    flags: torch.Tensor
    peer_flags: torch.Tensor
    epoch: torch.Tensor
    site: int

    @property
    def device(self) -> torch.device:
        """The partial's device."""
        return self.partial.device


def split_peer(y: torch.Tensor | PeerSum) -> tuple[torch.Tensor, PeerSum | None]:
    """(the tensor a kernel reads as y: this rank's partial of a PeerSum, else y itself; the PeerSum or None)."""
    return (y.partial, y) if isinstance(y, PeerSum) else (y, None)


def check_peer_sum(peer: PeerSum, n: int, d: int) -> None:
    """Raise, naming the field, on a PeerSum that cannot stand for the sum of [n, d] fp32 partials."""
    part = peer.partial
    if part.dtype != torch.float32 or tuple(part.shape) != (n, d) or part.stride(-1) != 1:
        raise ValueError(f"PeerSum.partial: expected fp32 [{n}, {d}] with contiguous rows, got {part.dtype} "
                         f"{tuple(part.shape)}")  # fmt: skip
    for name in ("send", "received"):
        slot = getattr(peer, name)
        if slot.dtype != torch.float32 or slot.dim() != 2 or slot.shape[0] < n or slot.shape[1] != d:
            raise ValueError(f"PeerSum.{name}: expected fp32 [>={n}, {d}], got {slot.dtype} {tuple(slot.shape)}")
        if not slot.is_contiguous():
            raise ValueError(f"PeerSum.{name}: expected a contiguous slot")
    for name in ("flags", "peer_flags"):
        flags = getattr(peer, name)
        if flags.dtype != torch.int64 or flags.dim() != 1 or flags.shape[0] < n or not flags.is_contiguous():
            raise ValueError(f"PeerSum.{name}: expected contiguous int64 [>={n}], got {flags.dtype} "
                             f"{tuple(flags.shape)}")  # fmt: skip
    if peer.epoch.dtype != torch.int64 or peer.epoch.numel() != 1:
        raise ValueError(f"PeerSum.epoch: expected one int64, got {peer.epoch.dtype} {tuple(peer.epoch.shape)}")
    if not 0 <= peer.site < SITES:
        raise ValueError(f"PeerSum.site: expected 0 to {SITES - 1}, got {peer.site}")
    devices = {t.device for t in (part, peer.send, peer.received, peer.flags, peer.peer_flags, peer.epoch)}
    if len(devices) != 1:
        raise ValueError("PeerSum: every tensor must be on one device")


@triton.jit
def exchange_row(partial_ptr, send_ptr, flags_ptr, peer_flags_ptr, epoch_ptr, site, row, D, stride_p, push,
                 BLOCK: tl.constexpr):  # fmt: skip
    """After the PDL wait: if `push`, store this rank's partial row into the peer's slot and raise the peer's flag
    for the row; then wait until the peer has raised this rank's."""
    use = tl.load(epoch_ptr) * _SITES + site
    if push:
        for d0 in range(0, D, BLOCK):
            cols = d0 + tl.arange(0, BLOCK)
            ok = cols < D
            tl.store(send_ptr + row * D + cols, tl.load(partial_ptr + row * stride_p + cols, mask=ok), mask=ok)
        tl.debug_barrier()  # every thread's stores, before the one thread's release
        tl.atomic_xchg(peer_flags_ptr + row, use, sem="release", scope="sys")
    while tl.atomic_add(flags_ptr + row, 0, sem="acquire", scope="sys") < use:
        pass


@triton.jit
def peer_row_sum(partial_ptr, received_ptr, row, cols, ok, D, stride_p):
    """This rank's partial plus the peer's, at `cols` of one row, in fp32 (one IEEE addition: either order)."""
    mine = tl.load(partial_ptr + row * stride_p + cols, mask=ok, other=0.0)
    theirs = tl.load(received_ptr + row * D + cols, mask=ok, other=0.0, cache_modifier=".cg")
    return mine + theirs


def peer_args(peer: PeerSum | None, dummy: torch.Tensor) -> tuple:
    """The kernels' peer arguments (received, send, flags, peer flags, epoch, site), `dummy` tensors without one."""
    if peer is None:
        return dummy, dummy, dummy, dummy, dummy, 0
    return peer.received, peer.send, peer.flags, peer.peer_flags, peer.epoch, peer.site
