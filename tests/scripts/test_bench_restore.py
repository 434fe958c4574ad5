"""scripts/bench_restore.py on the CPU (the pool's launch under the Triton interpreter): both ways leave the pool
with the same bits, the figures are reported, and it refuses without CUDA or with bad flags."""

from __future__ import annotations

import json
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch
from bench_restore import STATES, main, measure, parse_args, template_lane
from make_checkpoint import make_checkpoint

from tests.tiny import KERNEL_TEXT_TP2, text_config


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    path = make_checkpoint(text_config("base", **KERNEL_TEXT_TP2), tmp_path_factory.mktemp("restore"), fmt="bf16")
    return template_lane(path, 2, torch.device("cpu"))


def test_the_template_has_rank_0s_states_in_the_served_dtypes(template) -> None:
    assert template.gdn_conv and template.gdn_recurrent and template.ple_conv
    assert all(t.dtype == torch.bfloat16 for t in template.gdn_conv.values())
    assert all(t.dtype == torch.float32 for t in template.gdn_recurrent.values())
    assert all(t.device.type == "cpu" and not t.any() for name in STATES for t in getattr(template, name).values())


@pytest.mark.parametrize("lanes", [1, 3])
def test_both_ways_leave_the_same_bits_and_every_figure_is_reported(template, lanes) -> None:
    result = measure(template, lanes, 2, 1, torch.Generator().manual_seed(lanes))
    assert result["same_bits"] is True
    assert result["lanes"] == lanes and result["kept_rows"] == 2 * lanes
    timings = ("views_ms", "kept_rows_ms", "one_by_one_host_ms", "one_by_one_ms", "together_host_ms", "together_ms")
    assert all(result[k] >= 0 for k in timings)
    json.dumps(result)


def test_a_pool_left_with_other_bits_is_reported(template, monkeypatch) -> None:
    """A restore that leaves a state short of its row is caught: the comparison reads every byte."""
    import bench_restore

    real = bench_restore.LanePool.restore

    def short(self, restores):
        real(self, restores)
        next(iter(self.gdn_recurrent.values()))[0].view(-1)[0] += 1

    monkeypatch.setattr(bench_restore.LanePool, "restore", short)
    assert measure(template, 1, 2, 1, torch.Generator().manual_seed(0))["same_bits"] is False


def test_host_only_times_the_snapshots_of_every_lane_count_on_any_machine(template, tmp_path, monkeypatch) -> None:
    """--host-only needs no device: each lane count's kept rows made as views and as `KeptRow`s, written as JSON."""
    import bench_restore

    monkeypatch.setattr(bench_restore, "template_lane", lambda *_args: template)
    assert main(["--host-only", "--lanes", "1", "4", "--reps", "2", "--json", str(tmp_path / "r.json")]) == 0
    rows = json.loads((tmp_path / "r.json").read_text())
    assert [(r["lanes"], r["kept_rows"]) for r in rows] == [(1, 3), (4, 12)]
    assert all(r["views_ms"] > 0 and r["kept_rows_ms"] > 0 for r in rows)


def test_without_cuda_it_stops_with_2(capsys) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert main(["--lanes", "1"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--lanes", "0"], "--lanes: 0 is not a lane count"), (["--drafts", "0"], "--drafts: 0 is below 1"),
     (["--world", "0"], "--world: 0 is below 1"), (["--reps", "0"], "--reps: 0 is below 1")],
)  # fmt: skip
def test_bad_flags_are_refused_by_name(argv, message, capsys) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err
