"""scripts/gpu_step_profile.py on the CPU: the collectives its one-rank mode skips and the worlds it refuses, the
busy shares of overlapping kernels, a profile's busy time as step_profile.json keeps it, and its Chrome trace."""

from __future__ import annotations

import gzip
import json
import os
from collections import Counter
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"

import gpu_step_profile
import pytest
import torch

from model.parallel import TensorParallel


def test_a_rank_alone_keeps_its_partials_and_copies_its_slice() -> None:
    tp = TensorParallel(0, 2)
    partial = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    with gpu_step_profile.collectives_skipped():
        assert torch.equal(tp.reduce(partial.clone()), partial)
        assert torch.equal(tp.gather(partial), torch.cat([partial, partial], dim=-1))
        assert torch.equal(tp.combine_ordered(partial), partial * 2)
    assert tp.counts.calls == {"combine": 2, "gather": 1}


def test_the_collectives_come_back_afterwards() -> None:
    """Both collectives it stands in for are torch's again: without a process group each raises once more."""
    with gpu_step_profile.collectives_skipped():
        pass
    with pytest.raises((RuntimeError, ValueError)):
        TensorParallel(0, 2).gather(torch.ones(2))
    with pytest.raises((RuntimeError, ValueError)):
        TensorParallel(0, 2).reduce(torch.ones(2))


@pytest.mark.parametrize("world", ["1", "-2"])
def test_a_world_of_fewer_than_two_ranks_is_refused(world: str, capsys) -> None:
    with pytest.raises(SystemExit):
        gpu_step_profile.parse_args(["--out", "x", "--alone-as", world])
    assert "--alone-as" in capsys.readouterr().err


def test_busy_time_goes_to_the_earliest_started_kernel_running() -> None:
    spans = [("a", 0.0, 10.0), ("b", 2.0, 12.0), ("side", 3.0, 4.0), ("a", 15.0, 16.0), ("c", 15.5, 18.0)]
    shares, idle = gpu_step_profile.busy_shares(spans)
    assert shares == {"a": 11.0, "b": 2.0, "c": 2.0}
    assert idle == 3.0


def test_busy_shares_of_no_spans_are_empty() -> None:
    assert gpu_step_profile.busy_shares([]) == ({}, 0.0)


def test_a_profile_returns_rank_0s_busy_time_and_largest_shares_a_round(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    shares = Counter({f"k{i}": 100.0 * (i + 1) for i in range(gpu_step_profile.SHARES + 2)})
    monkeypatch.setattr(gpu_step_profile, "busy_shares", lambda spans: (shares, 500.0))
    _table, busy = gpu_step_profile.profile(lambda: torch.ones(4).sum(), "a step", rank=0, rounds=2)
    assert busy["ms"] == pytest.approx(sum(shares.values()) / 2e3) and busy["idle_ms"] == 0.25
    largest = sorted(shares, key=shares.get, reverse=True)[: gpu_step_profile.SHARES]
    assert list(busy["shares_ms"]) == largest
    assert busy["shares_ms"][largest[0]] == shares[largest[0]] / 2e3
    assert gpu_step_profile.profile(lambda: torch.ones(4).sum(), "a step", rank=1, rounds=2)[1] == {}


def test_a_profile_writes_its_rounds_as_a_gzipped_chrome_trace(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)  # no GPU here: CPU ops stand in for kernels
    trace = tmp_path / "step_trace.json.gz"
    gpu_step_profile.profile(lambda: torch.ones(64).cumsum(0), "a step", rank=0, rounds=2, trace=trace)
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    assert sum("cumsum" in event.get("name", "") for event in events) >= 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_trace.json.gz"]


def test_the_mtp_prompt_pass_gives_the_last_rows_logits_and_repeats() -> None:
    """The profiled MTP pass over a prompt's rows asks for the last row's logits only, and a second pass (the profile
    runs three) gives the first one's, with the layer's cache as long as the prompt."""
    import random

    from model.shipped import SHIPPED_MODEL
    from model.weights import load_model

    model = load_model(SHIPPED_MODEL)
    lane = model.new_lane()
    run = gpu_step_profile.mtp_prompt_pass(model, lane, 5, 200, random.Random(0))
    first, second = run(), run()
    assert first.shape[0] == 1 and torch.equal(first, second)
    assert lane.mtp_length == 5 and lane.mtp_attention.length == 5
