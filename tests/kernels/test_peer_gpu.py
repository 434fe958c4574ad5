"""Peer sums compiled on one GPU: two ranks' hyper writes run at once on two streams, each pushing its partial into
the other's slot and waiting for the other's flags, at the real per-rank shapes, eagerly and replayed in CUDA
graphs; every output has the bits of the two-rank partials summed by the all-reduce."""

from __future__ import annotations

import functools
import os
import time

os.environ.setdefault("TRITON_INTERPRET", "1")
# A precaution: streams share the GPU's hardware queues, whose work runs in order, so with the default eight a rank's
# stream could queue behind its peer's waiting kernel. Read when CUDA starts (this module run first or alone).
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

import pytest
import torch

from kernels.hyper import hc_write, hc_write_read
from kernels.peer import SLOTS, PeerSum

HC, D, R, EPS = 4, 2560, 320, 1e-6
ROWS = (1, 4, 64)
PDL_OFF_FROM = 16  # rows from which the ranks run without PDL (see docs/performance.md, thirty-first session)
SITES_A_FORWARD = 4
LIMIT_S = 30.0

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled kernels"),
]


@functools.cache
def rank_stream(rank: int) -> torch.cuda.Stream:
    """Each simulated rank's stream, made once: every new stream takes a hardware queue, and in a shared one a
    rank's work could wait behind its peer's waiting kernel."""
    return torch.cuda.Stream()


class Rank:
    """One simulated rank: its receive slots, flags and forward counter, its stream, and a view of its peer's."""

    def __init__(self, rows: int, index: int) -> None:
        self.slots = torch.zeros(SLOTS, rows, D, device="cuda")
        self.flags = torch.zeros(rows, dtype=torch.int64, device="cuda")
        self.epoch = torch.zeros(1, dtype=torch.int64, device="cuda")
        self.stream = rank_stream(index)
        self.marks: list[torch.cuda.Event] = []  # one after each site of the last forward launched

    def peer_sum(self, partial: torch.Tensor, peer: Rank, site: int) -> PeerSum:
        """This rank's PeerSum of `partial` at `site`: pushing into the peer's slot, waiting on its own flags."""
        slot = site % SLOTS
        return PeerSum(partial, peer.slots[slot], self.slots[slot], self.flags, peer.flags, self.epoch, site)


def inputs(n: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """A read's weights, wide rows, inject weights and two ranks' fp32 partials per site, on the GPU."""
    k = HC * D
    stacked = (torch.randn(R + HC, k, device="cuda", generator=gen) / k**0.5).bfloat16()
    scale = 10.0 ** torch.randint(-3, 4, (SITES_A_FORWARD, 2, n, D), device="cuda", generator=gen)
    return {
        "hc_norm_weight": (torch.randn(k, device="cuda", generator=gen) * 0.1).bfloat16(),
        "w_down": stacked[:R],
        "w_up": (torch.randn(k, R, device="cuda", generator=gen) * 2 / R**0.5).bfloat16(),
        "w_inject": stacked[R:],
        "wide": (torch.randn(n, k, device="cuda", generator=gen) * 3).bfloat16(),
        "inject": (torch.rand(n, HC, device="cuda", generator=gen) * 2).bfloat16(),
        "partials": torch.randn(SITES_A_FORWARD, 2, n, D, device="cuda", generator=gen) * scale,
    }


def forward(inp: dict[str, torch.Tensor], sum_at, marks: list | None = None) -> list[torch.Tensor]:
    """A forward of SITES_A_FORWARD writes: odd sites a write then read, even sites a write alone (hc_write), each
    rank's rows the previous site's new rows; `sum_at(site)` gives the site's y (a PeerSum or the partials); an
    event recorded into `marks` after each site."""
    weights = (inp["hc_norm_weight"], inp["w_down"], inp["w_up"], inp["w_inject"], EPS, HC)
    wide, outs = inp["wide"], []
    for site in range(SITES_A_FORWARD):
        if site % 2:
            wide, x, inj = hc_write_read(wide, sum_at(site), inp["inject"], *weights)
            outs += [wide, x, inj]
        else:
            wide = hc_write(wide, sum_at(site), inp["inject"])
            outs.append(wide)
        if marks is not None:
            marks.append(torch.cuda.Event())
            marks[-1].record()
    return outs


def both_ranks(ranks: list[Rank], inp: dict[str, torch.Tensor]) -> list[list[torch.Tensor]]:
    """Each rank's forward on its own stream, the epoch advanced first, as the model does."""
    outs = []
    for r, rank in enumerate(ranks):
        rank.marks = []
        with torch.cuda.stream(rank.stream):
            rank.epoch.add_(1)
            peer_sum = lambda site, r=r: ranks[r].peer_sum(inp["partials"][site, r], ranks[1 - r], site)  # noqa: E731
            outs.append(forward(inp, peer_sum, rank.marks))
    return outs


def warm_up(ranks: list[Rank], inp: dict[str, torch.Tensor]) -> None:
    """Each rank's forward once with its flags raised past any use number, so nothing waits: every kernel compiled
    and every output allocated before the ranks run at once. (One host thread drives both ranks here, the first's
    launches before the second's; a compile or an allocation that waited for the GPU there would wait for a kernel
    whose peer was never launched. Each real rank has a host and a GPU of its own.)"""
    for rank in ranks:
        rank.flags.fill_(1 << 62)
    both_ranks(ranks, inp)
    torch.cuda.synchronize()
    for rank in ranks:
        rank.flags.zero_()
        rank.epoch.zero_()
    torch.cuda.synchronize()


def wait(ranks: list[Rank]) -> None:
    """Both streams done within LIMIT_S, or the test fails (a rank waiting for a flag that never comes)."""
    done = [torch.cuda.Event() for _ in ranks]
    for event, rank in zip(done, ranks, strict=True):
        event.record(rank.stream)
    start = time.monotonic()
    while not all(e.query() for e in done):
        sites = [sum(mark.query() for mark in rank.marks) for rank in ranks]
        assert time.monotonic() - start < LIMIT_S, f"a rank still waits for its peer's flag (sites done: {sites})"
        time.sleep(0.01)


@pytest.mark.parametrize("n", ROWS)
def test_two_ranks_at_once_get_the_all_reduces_bits(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    if n >= PDL_OFF_FROM:
        monkeypatch.setenv("FLASHNEXT_PDL", "0")
    inp = inputs(n, torch.Generator(device="cuda").manual_seed(n))
    want = forward(inp, lambda site: inp["partials"][site])
    ranks = [Rank(max(ROWS), r) for r in range(2)]
    warm_up(ranks, inp)
    for _ in range(3):  # three forwards: the use numbers grow by epoch
        outs = both_ranks(ranks, inp)
        wait(ranks)
        for got in outs:
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert [int(rank.epoch) for rank in ranks] == [3, 3]


@pytest.mark.parametrize("n", (1, 64))
def test_two_ranks_replaying_graphs_at_once_get_the_all_reduces_bits(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    if n >= PDL_OFF_FROM:
        monkeypatch.setenv("FLASHNEXT_PDL", "0")
    inp = inputs(n, torch.Generator(device="cuda").manual_seed(100 + n))
    want = forward(inp, lambda site: inp["partials"][site])
    ranks = [Rank(max(ROWS), r) for r in range(2)]
    warm_up(ranks, inp)
    graphs, outs = [torch.cuda.CUDAGraph() for _ in ranks], [None, None]
    for r, (rank, graph) in enumerate(zip(ranks, graphs, strict=True)):
        with torch.cuda.graph(graph, stream=rank.stream):
            rank.epoch.add_(1)
            outs[r] = forward(inp, lambda site, r=r: ranks[r].peer_sum(inp["partials"][site, r], ranks[1 - r], site))
    for _ in range(4):
        for rank, graph in zip(ranks, graphs, strict=True):
            with torch.cuda.stream(rank.stream):
                graph.replay()
        wait(ranks)
        for got in outs:
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert [int(rank.epoch) for rank in ranks] == [4, 4]
