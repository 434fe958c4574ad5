"""Peer sums on two GPUs: `PeerSums.open` maps each rank's peer (symmetric memory over NVLink), and writes alone and
inside reads, with PDL as served, give both ranks the all-reduce's bits at 1 and 64 rows, forward after forward.
Needs two CUDA devices (nvidia-h200-x2); skipped elsewhere."""

from __future__ import annotations

import os
from datetime import timedelta

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast on the lent machines
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from model.peer_sums import PeerSums, forward_sites
from server.ranks import free_port
from tests.kernels.test_peer_gpu import D, forward, inputs
from tests.two_ranks import run_two_ranks

ROWS = (1, 64)
FORWARDS = 3
LIMIT_S = 300

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled kernels"),
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"),
]


def rank_main(rank: int, port: int, results) -> None:
    """This rank's forwards with peer sums, each output compared with the two partials summed in memory."""
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=120)
    )
    try:
        peer = PeerSums.open(torch.device("cuda", rank), D)
        same = []
        for n in ROWS:
            inp = inputs(n, torch.Generator(device="cuda").manual_seed(n))  # the same on both ranks
            want = forward(inp, lambda site, inp=inp: inp["partials"][site])
            for _ in range(FORWARDS):
                with forward_sites(peer):
                    got = forward(inp, lambda site, inp=inp: peer.pending(inp["partials"][site, rank]))
                same.append(all(torch.equal(a, b) for a, b in zip(got, want, strict=True)))
        torch.cuda.synchronize()
        results[rank] = same
    finally:
        dist.destroy_process_group()


def test_two_gpus_exchanging_partials_get_the_all_reduces_bits() -> None:
    results = mp.Manager().dict()
    run_two_ranks(rank_main, (free_port(), results), LIMIT_S)
    assert results[0] == results[1] == [True] * (len(ROWS) * FORWARDS)
