"""The ranks' combines summed inside the next hyper write over NVLink (kernels/peer.py), not by an NCCL all-reduce:
each GPU's receive slots and flags in symmetric memory (opened once, both ranks together), the forward counter the
flags' use numbers start from, and each call's site in its forward. FLASHNEXT_PEER_SUMS=1 asks for it at --tp 2 on
CUDA with the kernels on; rounds of more than PEER_ROWS rows (prompts) keep the all-reduce."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from kernels.peer import SITES, SLOTS, PeerSum

ENV = "FLASHNEXT_PEER_SUMS"
PEER_ROWS = 256  # rows of a round whose combines are exchanged: a verify round of 64 lanes of four rows


class PeerSums:
    """This rank's side of the exchange with its one peer: its receive slots [SLOTS, PEER_ROWS, d] fp32 and row
    flags [PEER_ROWS] int64, the peer's (`send`, `peer_flags`: where this rank pushes), and the forward counter."""

    def __init__(self, received: torch.Tensor, send: torch.Tensor, flags: torch.Tensor, peer_flags: torch.Tensor):
        self.received, self.send, self.flags, self.peer_flags = received, send, flags, peer_flags
        self.handles: tuple = ()  # the symmetric-memory handles of `open`
        self.epoch = torch.zeros(1, dtype=torch.int64, device=flags.device)
        self.site = 0

    @classmethod
    def open(cls, device: torch.device, d: int) -> PeerSums:
        """Allocate this rank's slots and flags in symmetric memory and map the peer's: a collective, both ranks
        call it at once."""
        from torch.distributed import _symmetric_memory as symm_mem

        if device.type != "cuda" or dist.get_world_size() != 2:
            raise ValueError(f"{ENV}=1: peer sums join two ranks on CUDA, not {dist.get_world_size()} on {device.type}")
        peer = 1 - dist.get_rank()
        group = dist.group.WORLD.group_name
        received = symm_mem.empty(SLOTS, PEER_ROWS, d, dtype=torch.float32, device=device)
        flags = symm_mem.empty(PEER_ROWS, dtype=torch.int64, device=device)
        flags.zero_()
        handles = symm_mem.rendezvous(received, group), symm_mem.rendezvous(flags, group)
        send = handles[0].get_buffer(peer, (SLOTS, PEER_ROWS, d), torch.float32)
        peer_flags = handles[1].get_buffer(peer, (PEER_ROWS,), torch.int64)
        torch.cuda.synchronize(device)
        dist.barrier()  # both ranks' flags are zero before either raises one
        opened = cls(received, send, flags, peer_flags)
        opened.handles = handles  # the peer's memory stays mapped while the views of it live
        return opened

    def pending(self, partial: torch.Tensor) -> PeerSum | None:
        """This rank's fp32 partial [N, d] as the next call's PeerSum, or None with no rows or above the slots' rows
        (PEER_ROWS): the same choice at both ranks, whose rounds have the same rows."""
        if not 0 < partial.shape[0] <= self.received.shape[1]:
            return None
        if self.site >= SITES:
            raise RuntimeError(f"{ENV}=1: a forward made more than {SITES} combines")
        slot = self.site % SLOTS
        site, self.site = self.site, self.site + 1
        return PeerSum(partial, self.send[slot], self.received[slot], self.flags, self.peer_flags, self.epoch, site)


@contextlib.contextmanager
def forward_sites(peer: PeerSums | None) -> Iterator[None]:
    """One forward's calls: the forward counter advanced on the device first, sites counted from zero, and an even
    count of them at the end (the receive slots alternate by site)."""
    if peer is None:
        yield
        return
    peer.epoch.add_(1)
    peer.site = 0
    yield
    if peer.site % SLOTS:
        raise RuntimeError(f"{ENV}=1: a forward made {peer.site} exchanged combines; the slots need an even count")
