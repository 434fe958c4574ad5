"""Two ranks' partials exchanged inside the hyper write (kernels/peer.py), interpreted: the write and the read take
the bits of the two partials summed in rank order, push this rank's partial to the peer and raise its flags, and
wait for the peer's flags."""

from __future__ import annotations

import dataclasses
import os
import threading
import time

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from kernels import hyper
from kernels.hyper import ReadTiles, hc_write, hc_write_read, launch_read
from kernels.peer import SITES, PeerSum
from tests.kernels.test_hyper import EPS, weights, wide_rows

EPOCH, SITE = 3, 5
USE = EPOCH * SITES + SITE
SLOT_ROWS = 8


def peer_sum(mine: torch.Tensor, theirs: torch.Tensor, raised: bool = True) -> PeerSum:
    """This rank's view of a two-rank sum whose peer has already pushed `theirs` (and raised the flags if
    `raised`); `send` stands for the peer's receive slot and `peer_flags` for its flags."""
    n, d = mine.shape
    received = torch.zeros(SLOT_ROWS, d)
    received[:n] = theirs
    flags = torch.full((SLOT_ROWS,), USE if raised else USE - 1, dtype=torch.int64)
    return PeerSum(
        partial=mine,
        send=torch.zeros(SLOT_ROWS, d),
        received=received,
        flags=flags,
        peer_flags=torch.zeros(SLOT_ROWS, dtype=torch.int64),
        epoch=torch.tensor([EPOCH]),
        site=SITE,
    )


def assert_pushed(peer: PeerSum, n: int) -> None:
    """The rank's partial rows are in the peer's slot and their flags carry the call's use number; no other row."""
    assert torch.equal(peer.send[:n], peer.partial)
    assert torch.equal(peer.send[n:], torch.zeros_like(peer.send[n:]))
    assert peer.peer_flags[:n].tolist() == [USE] * n
    assert peer.peer_flags[n:].tolist() == [0] * (SLOT_ROWS - n)


def partials(n: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two ranks' fp32 partials with a wide spread of magnitudes, so the sum rounds."""
    g = torch.Generator().manual_seed(seed)
    scale = 10.0 ** torch.randint(-3, 4, (n, d), generator=g)
    return torch.randn(n, d, generator=g) * scale, torch.randn(n, d, generator=g) * scale


@pytest.mark.parametrize("act", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "tiles", [ReadTiles(16, 16, 16, 16, False, 4, 1), ReadTiles(16, 16, 16, 16, True, 4, 1, True, True)]
)
def test_a_peer_sum_in_the_read_gives_the_ranks_partials_bits(act: torch.dtype, tiles: ReadTiles) -> None:
    """The write inside the read sums this rank's partial and the received one as the two-rank partials are
    summed: the new rows, x and inject equal hc_write_read's over [p0, p1], at either rank."""
    n, d = 5, 32
    w, wide = weights(4, act, seed=70), wide_rows(n, 4, act, seed=71)
    inj = (torch.rand(n, 4, generator=torch.Generator().manual_seed(72)) * 2).to(act)
    p0, p1 = partials(n, d, seed=73)
    args = (w["hc_norm_weight"], w["w_down"], w["w_up"], w["w_inject"], EPS, 4, tiles)
    want_out = torch.empty_like(wide)
    want_x, want_inj = launch_read(wide, *args, write=hyper.Write(torch.stack([p0, p1]), inj, want_out))
    for mine, theirs in ((p0, p1), (p1, p0)):
        peer = peer_sum(mine, theirs)
        out = torch.empty_like(wide)
        x, read_inj = launch_read(wide, *args, write=hyper.Write(peer, inj, out))
        assert torch.equal(out, want_out) and torch.equal(x, want_x) and torch.equal(read_inj, want_inj)
        assert_pushed(peer, n)
    new_wide, x2, _ = hc_write_read(wide, peer_sum(p0, p1), inj, *args[:-1])
    assert torch.equal(new_wide, want_out) and torch.equal(x2, want_x)


@pytest.mark.parametrize("act", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d", [320, 1040])  # one program a row; two (chunks of 1,024 past RSTD_ONE_CHUNK)
def test_a_peer_sum_in_the_write_gives_the_ranks_partials_bits(
    act: torch.dtype, d: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """hc_write with a PeerSum: the bits of the two-rank partials, the row pushed whole by its first program."""
    monkeypatch.setattr(hyper, "RSTD_ONE_CHUNK", 1024)
    n = 3
    wide = wide_rows(n, 4, act, seed=74, d=d)
    inj = (torch.rand(n, 4, generator=torch.Generator().manual_seed(75)) * 2).to(act)
    p0, p1 = partials(n, d, seed=76)
    want = hc_write(wide, torch.stack([p0, p1]), inj)
    peer = peer_sum(p1, p0)
    assert torch.equal(hc_write(wide, peer, inj), want)
    assert_pushed(peer, n)


def test_the_chunked_rstd_kernel_pushes_whole_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Streams wider than the rstd kernel holds whole (d = 1,040 in chunks of 1,024): the exchange pushes every
    column of the row and the sums still take the partials' bits."""
    monkeypatch.setattr(hyper, "RSTD_ONE_CHUNK", 1024)
    n, d = 2, 1040
    w, wide = weights(4, torch.float32, seed=77, d=d), wide_rows(n, 4, torch.float32, seed=78, d=d)
    inj = torch.rand(n, 4, generator=torch.Generator().manual_seed(79)) * 2
    p0, p1 = partials(n, d, seed=80)
    args = (w["hc_norm_weight"], w["w_down"], w["w_up"], w["w_inject"], EPS, 4)
    want = hc_write_read(wide, torch.stack([p0, p1]), inj, *args)
    peer = peer_sum(p0, p1)
    got = hc_write_read(wide, peer, inj, *args)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert_pushed(peer, n)


def test_the_write_waits_for_the_peers_flag() -> None:
    """With the flag one below the call's use number the write does not finish; it does once the flag is raised."""
    n, d = 2, 32
    wide = wide_rows(n, 4, torch.float32, seed=81)
    inj = torch.rand(n, 4, generator=torch.Generator().manual_seed(82))
    p0, p1 = partials(n, d, seed=83)
    peer = peer_sum(p0, p1, raised=False)
    result: dict[str, torch.Tensor] = {}
    worker = threading.Thread(target=lambda: result.update(out=hc_write(wide, peer, inj)), daemon=True)
    worker.start()
    deadline = time.monotonic() + 60
    while int(peer.peer_flags[0]) != USE:  # the first row's program has pushed: it is waiting, or past its wait
        assert time.monotonic() < deadline, "the write never pushed its first row"
        time.sleep(0.01)
    time.sleep(0.5)
    waited = worker.is_alive()
    peer.flags.fill_(USE)
    worker.join(timeout=60)
    assert waited, "the write finished before the peer raised its flag"
    assert not worker.is_alive() and torch.equal(result["out"], hc_write(wide, torch.stack([p0, p1]), inj))


def test_a_peer_sum_is_refused_by_field() -> None:
    n, d = 2, 32
    wide = wide_rows(n, 4, torch.float32, seed=84)
    inj = torch.rand(n, 4)
    good = peer_sum(*partials(n, d, seed=85))
    bad = {
        "partial": good.partial.double(),
        "send": good.send[:1],
        "received": good.received[:, :16],
        "flags": good.flags.int(),
        "peer_flags": good.peer_flags[:1],
        "epoch": torch.zeros(2, dtype=torch.int64),
        "site": SITES,
    }
    for field, value in bad.items():
        with pytest.raises(ValueError, match=f"PeerSum.{field}"):
            hc_write(wide, dataclasses.replace(good, **{field: value}), inj)
    elsewhere = dataclasses.replace(good, epoch=torch.zeros(1, dtype=torch.int64, device="meta"))
    with pytest.raises(ValueError, match="PeerSum: every tensor must be on one device"):
        hc_write(wide, elsewhere, inj)
    with pytest.raises(TypeError, match="hc_write_reference: a PeerSum is summed by the kernels only"):
        hyper.hc_write_reference(wide, good, inj)
