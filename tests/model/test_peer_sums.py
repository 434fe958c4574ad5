"""Peer sums (model/peer_sums.py): sites and slots of a forward's calls, and the kernel path at two ranks giving the
all-reduce's bits with the ranks' partials exchanged inside the hyper writes (interpreted, over shared CPU memory)."""

from __future__ import annotations

import os
from datetime import timedelta

os.environ["TRITON_INTERPRET"] = "1"  # the kernel path on CPU, in the spawned ranks too

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from make_checkpoint import make_checkpoint

from kernels.peer import SITES, SLOTS, PeerSum
from model.config import load_config
from model.flashnext import single_lane_batch
from model.kernel_blocks import write_input
from model.parallel import TensorParallel
from model.peer_sums import ENV, PeerSums, forward_sites
from model.weights import load_model
from server.ranks import free_port
from tests.tiny import KERNEL_TEXT_TP2, text_config
from tests.two_ranks import run_two_ranks

SLOT_ROWS = 4
PROMPTS = (torch.tensor([7, 19, 5]), torch.tensor([4, 8, 15, 16, 23]))  # rows within a slot, then past it
STEPS = 1  # a decode step after each prompt: one-row exchanges (more steps only repeat them)
LIMIT_S = 600  # for the two ranks' forwards


def cpu_peer(d: int = 16, rows: int = SLOT_ROWS) -> PeerSums:
    """A rank's PeerSums over plain CPU tensors (its peer's slots and flags stand in as tensors of their own)."""
    zeros = lambda *shape, dtype=torch.float32: torch.zeros(*shape, dtype=dtype)  # noqa: E731
    return PeerSums(zeros(SLOTS, rows, d), zeros(SLOTS, rows, d), zeros(rows, dtype=torch.int64),
                    zeros(rows, dtype=torch.int64))  # fmt: skip


def test_a_forwards_calls_take_sites_in_order_and_slots_in_turn() -> None:
    peer = cpu_peer()
    partial = torch.randn(3, 16)
    with forward_sites(peer):
        calls = [peer.pending(partial) for _ in range(4)]
    assert [c.site for c in calls] == [0, 1, 2, 3] and int(peer.epoch) == 1
    assert [c.received.data_ptr() for c in calls] == [peer.received[i % SLOTS].data_ptr() for i in range(4)]
    assert [c.send.data_ptr() for c in calls] == [peer.send[i % SLOTS].data_ptr() for i in range(4)]
    assert all(c.partial is partial and c.flags is peer.flags and c.epoch is peer.epoch for c in calls)
    with forward_sites(peer):
        assert peer.pending(partial).site == 0
        assert peer.pending(torch.randn(SLOT_ROWS + 1, 16)) is None  # more rows than a slot: the all-reduce
        assert peer.pending(torch.randn(0, 16)) is None  # no rows: no launch would exchange it
        assert peer.pending(partial).site == 1
    assert int(peer.epoch) == 2


def test_a_forward_with_an_odd_count_of_calls_is_refused() -> None:
    peer = cpu_peer()
    with pytest.raises(RuntimeError, match=f"{ENV}=1: a forward made 3"), forward_sites(peer):
        for _ in range(3):
            peer.pending(torch.randn(1, 16))
    peer.site = SITES
    with pytest.raises(RuntimeError, match=f"more than {SITES}"):
        peer.pending(torch.randn(1, 16))


def test_tensor_parallel_exchanges_only_at_two_ranks_with_peer_sums(monkeypatch: pytest.MonkeyPatch) -> None:
    partial = torch.randn(2, 16)
    assert TensorParallel(0, 1, peer=cpu_peer()).pending(partial) is partial  # one rank: nothing to sum
    tp = TensorParallel(0, 2, peer=cpu_peer())
    with forward_sites(tp.peer):
        exchanged = tp.pending(partial)
        assert isinstance(exchanged, PeerSum) and exchanged.partial is partial
        assert tp.counts.calls["combine"] == 1 and tp.counts.bytes["combine"] == partial.numel() * 4
        monkeypatch.setattr(TensorParallel, "reduce", lambda self, p: "all-reduced")
        assert tp.pending(torch.randn(SLOT_ROWS + 1, 16)) == "all-reduced"
        assert TensorParallel(0, 2).pending(partial) == "all-reduced"
        tp.pending(partial)
    wide = torch.zeros(2, 64, dtype=torch.bfloat16)
    assert write_input(exchanged, wide) is exchanged


def rank_main(rank: int, port: int, path: str, slots: list[torch.Tensor], flags: list[torch.Tensor], results) -> None:
    """Both prompts (the longer one past a slot's rows: all-reduced) then greedy steps, at this rank, with the
    all-reduce and with peer sums; the logits of every forward."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=120)
    )
    try:
        out = {}
        for mode in ("all_reduce", "peer"):
            peer = PeerSums(slots[rank], slots[1 - rank], flags[rank], flags[1 - rank]) if mode == "peer" else None
            model = load_model(path, dtype="bfloat16", tp=TensorParallel(rank, 2, peer=peer), kernels="on")
            logits = []
            for prompt in PROMPTS:
                lane = model.new_lane()
                last = model(single_lane_batch(lane, prompt, 0)).logits
                logits.append(last)
                for _ in range(STEPS):
                    token = torch.tensor([int(last[-1].float().argmax())])
                    last = model(single_lane_batch(lane, token, lane.length)).logits
                    logits.append(last)
            out[mode] = (logits, None if peer is None else int(peer.epoch))
        results[rank] = out
    finally:
        dist.destroy_process_group()


def test_two_ranks_exchanging_partials_get_the_all_reduces_bits(tmp_path) -> None:
    """The kernel path at two ranks: every forward's logits with peer sums equal the all-reduce's, bit for bit, on
    both ranks (each rank's interpreted writes wait for the other's pushes in shared memory)."""
    path = make_checkpoint(text_config("base", **KERNEL_TEXT_TP2), tmp_path, fmt="bf16")
    d = load_config(path).hidden_size
    slots = [torch.zeros(SLOTS, SLOT_ROWS, d).share_memory_() for _ in range(2)]
    flags = [torch.zeros(SLOT_ROWS, dtype=torch.int64).share_memory_() for _ in range(2)]
    results = mp.Manager().dict()
    run_two_ranks(rank_main, (free_port(), str(path), slots, flags, results), LIMIT_S)
    forwards = len(PROMPTS) * (1 + STEPS)
    for rank in (0, 1):
        (reduced, _), (exchanged, epochs) = results[rank]["all_reduce"], results[rank]["peer"]
        assert epochs == forwards
        assert all(torch.equal(a, b) for a, b in zip(reduced, exchanged, strict=True)), rank
    assert all(torch.equal(a, b) for a, b in zip(results[0]["peer"][0], results[1]["peer"][0], strict=True))
    assert int(flags[0].max()) > 0 and int(flags[1].max()) > 0  # the ranks did exchange
