"""What the in-kernel exchange of peer sums (kernels/peer.py) costs, simulated on one GPU: two ranks' chains of hyper
write + read launches, each write exchanging the ranks' partials, replayed as CUDA graphs on two streams at once,
against the same two chains, and one alone, whose writes sum both partials given in memory (the all-reduce's
consumer, the all-reduce itself left out). The "peer" here is the same GPU, so a push crosses L2, not NVLink:
this bounds the handshake's own cost from below; the two-GPU figure needs `torchrun --nproc-per-node 2
scripts/gpu_step_profile.py --peer-sums`.

python3 scripts/gpu_peer_sim.py [--rows 1 4 64] [--sites 48]   # per-rank shapes of tp=2; prints µs a site
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "0")
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")  # the two ranks' streams in queues of their own
ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]

import torch  # noqa: E402

from kernels.hyper import hc_write_read  # noqa: E402
from tests.kernels.test_peer_gpu import EPS, HC, PDL_OFF_FROM, Rank, inputs  # noqa: E402

REPLAYS = 20


def chain(inp: dict[str, torch.Tensor], sites: int, sum_at) -> None:
    """`sites` writes, each inside a read of the rows the last one wrote (`sum_at(site)`: the write's y)."""
    weights = (inp["hc_norm_weight"], inp["w_down"], inp["w_up"], inp["w_inject"], EPS, HC)
    wide = inp["wide"]
    for site in range(sites):
        wide, _, _ = hc_write_read(wide, sum_at(site), inp["inject"], *weights)


def median_us(replay, streams: list[torch.cuda.Stream], sites: int) -> float:
    """Median over REPLAYS of the span from one start to the last stream's end, per site."""
    spans = []
    for _ in range(REPLAYS):
        start = torch.cuda.Event(enable_timing=True)
        ends = [torch.cuda.Event(enable_timing=True) for _ in streams]
        start.record()
        for stream in streams:
            stream.wait_event(start)
        replay()
        for stream, end in zip(streams, ends, strict=True):
            end.record(stream)
        torch.cuda.synchronize()
        spans.append(max(start.elapsed_time(end) for end in ends) * 1000 / sites)
    return sorted(spans)[len(spans) // 2]


def captured(stream: torch.cuda.Stream, body) -> torch.cuda.CUDAGraph:
    """body() run once on `stream` (compiles, allocates), then captured there."""
    with torch.cuda.stream(stream):
        body()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        body()
    return graph


def run(n: int, sites: int) -> tuple[float, float, float]:
    """µs a site: one chain alone with the partials given; two chains at once (the ranks' streams), the partials
    given; the two exchanging them."""
    inp = inputs(n, torch.Generator(device="cuda").manual_seed(n))
    partials = [inp["partials"][site % len(inp["partials"])] for site in range(sites)]
    ranks = [Rank(n, r) for r in range(2)]
    streams = [rank.stream for rank in ranks]

    def replay_on(graphs: list[torch.cuda.CUDAGraph]):
        return lambda: [_on(stream, graph.replay) for stream, graph in zip(streams, graphs, strict=False)]

    given = [captured(stream, lambda: chain(inp, sites, lambda site: partials[site])) for stream in streams]
    alone_us = median_us(replay_on(given[:1]), streams[:1], sites)
    two_given_us = median_us(replay_on(given), streams, sites)

    for rank in ranks:  # compiled and allocated with nothing to wait for, as the GPU test warms up
        rank.flags.fill_(1 << 62)

    def forward(r: int) -> None:  # a rank's forward: the epoch advanced, then its chain
        ranks[r].epoch.add_(1)
        chain(inp, sites, lambda site: ranks[r].peer_sum(partials[site][r], ranks[1 - r], site))

    exchanging = [captured(rank.stream, functools.partial(forward, r)) for r, rank in enumerate(ranks)]
    for rank in ranks:
        rank.flags.zero_()
        rank.epoch.zero_()
    torch.cuda.synchronize()
    return alone_us, two_given_us, median_us(replay_on(exchanging), streams, sites)


def _on(stream: torch.cuda.Stream, fn) -> None:
    """fn() with `stream` current."""
    with torch.cuda.stream(stream):
        fn()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 64], help="rows of each case")
    ap.add_argument("--sites", type=int, default=48, help="writes a chain makes (even)")
    args = ap.parse_args()
    for n in args.rows:
        os.environ["FLASHNEXT_PDL"] = "0" if n >= PDL_OFF_FROM else "1"  # as the GPU test runs them
        alone, two_given, exchanged = run(n, args.sites)
        print(f"rows {n} (PDL {os.environ['FLASHNEXT_PDL']}), write + read, µs a site: one chain, partials given "
              f"{alone:.2f}; two at once, given {two_given:.2f}; two at once, exchanged {exchanged:.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
