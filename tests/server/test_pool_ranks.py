"""Both ranks reserve lane-pool slots of one context: the shortest any rank's free memory allows."""

from __future__ import annotations

import argparse
import os
from datetime import timedelta

os.environ["TRITON_INTERPRET"] = "1"  # the kernel path on CPU, in the spawned ranks too

import torch.distributed as dist
import torch.multiprocessing as mp
from make_checkpoint import make_checkpoint

from model.parallel import TensorParallel
from model.state import slot_state_bytes
from model.weights import load_model
from server import serve
from server.ranks import free_port
from tests.tiny import text_config

TEXT = {"linear_key_head_dim": 16, "linear_value_head_dim": 16, "indexer_budget": 4}
LANES = 3


def rank_main(rank: int, port: int, path: str, results) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    try:
        model = load_model(path, dtype="bfloat16", tp=TensorParallel(rank, 2), kernels="on")
        cfg = model.cfg
        slot_bytes = lambda n: slot_state_bytes(model.new_lane(), n, cfg.indexer_compress_ratio)  # noqa: E731
        free = int((LANES + 1) * slot_bytes(1024 if rank == 0 else 512) / serve.POOL_SHARE)  # rank 1 has less
        serve.free_memory = lambda device, utilization=None: free
        alone = serve.pool_context(None, cfg.max_position_embeddings, slot_bytes, LANES, free)
        args = argparse.Namespace(
            context=None, max_lanes=LANES, cuda_graphs="off", ngram_table="device", prompt_budget=16, drafts=3
        )
        context = serve.plan_lanes(args, model)
        results[rank] = (alone, context, model.lane_pool.context)
    finally:
        dist.destroy_process_group()


def test_the_ranks_agree_on_the_shortest_context(tmp_path) -> None:
    path = make_checkpoint(text_config("base", **TEXT), tmp_path, fmt="bf16")
    results = mp.Manager().dict()
    mp.start_processes(rank_main, args=(free_port(), str(path), results), nprocs=2, start_method="spawn")
    (alone0, context0, pool0), (alone1, context1, pool1) = results[0], results[1]
    assert alone0 > alone1  # left to itself, rank 0 would serve a longer context than rank 1 can hold
    assert context0 == context1 == alone1 and pool0 == pool1
