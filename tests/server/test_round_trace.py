"""FLASHNEXT_ROUND_TRACE: each round's phases go to the rank's trace file, and trace_summary groups them."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from model.weights import load_model
from rankwire.header import DrawSpec
from server.engine import Engine, Request
from server.round_trace import RoundTrace
from server.serve import rank_runner
from server.settings import read_environment
from tests.server.engine_harness import Outcome
from tests.tiny import checkpoint

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "trace_summary.py"
spec = importlib.util.spec_from_file_location("trace_summary", SCRIPT)
assert spec is not None and spec.loader is not None
summary = importlib.util.module_from_spec(spec)
sys.modules["trace_summary"] = summary
spec.loader.exec_module(summary)


def test_every_round_writes_its_rows_and_phases(tmp_path):
    model = load_model(checkpoint(tmp_path / "m"), dtype="float32")
    env = read_environment({"FLASHNEXT_ROUND_TRACE": str(tmp_path)})
    engine = Engine(rank_runner(model, 1, 0, env), context=256, prompt_budget=4)
    outcome = Outcome()
    engine.start()
    try:
        engine.submit(Request("r", [5, 9, 14, 3, 22, 8], 3, DrawSpec(0.0, 0, 1.0, 0.0, 1), frozenset(), outcome.sink))
        assert outcome.done.wait(120)
    finally:
        engine.stop()
    lines = [json.loads(t) for t in (tmp_path / "rank0.trace").read_text().splitlines()]
    with_rows = [line for line in lines if line.get("rows")]
    # two prompt rounds of 4 and 2 rows, then one decode row a round for the 2 tokens after the first
    assert [line["rows"] for line in with_rows] == [4, 2, 1, 1]
    for line in with_rows:
        assert {"plan", "prepare", "agree", "forward", "draw", "verify", "post"} <= line["phases"].keys()
        assert all(seconds >= 0 for seconds in line["phases"].values())
        assert line["replays"] == {}  # no graphs: every forward ran eagerly


def test_summary_groups_rounds_by_rows_and_graphs():
    lines = [
        {"lanes": 1, "rows": 1, "replays": {"trunk": 1}, "phases": {"forward": 0.001, "draw": 0.010}},
        {"lanes": 1, "rows": 1, "replays": {"trunk": 1}, "phases": {"forward": 0.003, "draw": 0.020}},
        {"lanes": 1, "rows": 1, "replays": {"trunk": 1}, "phases": {"forward": 0.002, "draw": 0.030}},
        {"lanes": 2, "rows": 8, "replays": {}, "phases": {"forward": 0.050}},
    ]
    entries = summary.summarise(lines)
    assert [(e["kind"], e["rounds"]) for e in entries] == [
        ("lanes=1 rows=1 trunk", 3),
        ("lanes=2 rows=8 eager", 1),
    ]
    assert entries[0]["median_ms"] == pytest.approx({"draw": 20.0, "forward": 2.0})
    assert entries[0]["total_ms"] == pytest.approx(23.0)  # the median round's total, not the sum of medians
    assert summary.summarise(lines, min_rounds=2) == entries[:1]


def test_summary_takes_the_median_of_each_gpu_span():
    lines = [
        {
            "lanes": 2,
            "rows": 2,
            "replays": {"trunk": 1},
            "phases": {"draw": 0.01},
            "gpu": {"forward": 9.0, "draw": 0.2},
        },
        {
            "lanes": 2,
            "rows": 2,
            "replays": {"trunk": 1},
            "phases": {"draw": 0.01},
            "gpu": {"forward": 7.0, "draw": 0.4},
        },
        {
            "lanes": 2,
            "rows": 2,
            "replays": {"trunk": 1},
            "phases": {"draw": 0.01},
            "gpu": {"forward": 8.0, "draw": 0.3},
        },
        {"lanes": 1, "rows": 1, "replays": {"trunk": 1}, "phases": {"draw": 0.01}},
    ]
    entries = summary.summarise(lines)
    assert entries[0]["gpu_ms"] == pytest.approx({"forward": 8.0, "draw": 0.3})
    assert "gpu_ms" not in entries[1]  # a CPU round has no GPU points


class Event:
    """A stand-in for a CUDA event at a time in ms, which the GPU has passed or not."""

    def __init__(self, at: float, passed: bool = True) -> None:
        self.at, self.passed = at, passed

    def elapsed_time(self, end: Event) -> float:
        return end.at - self.at

    def query(self) -> bool:
        return self.passed


def test_gpu_spans_name_each_span_after_its_end_point():
    events = [("start", Event(1.0)), ("forward", Event(9.5)), ("draw", Event(9.75))]
    assert RoundTrace.gpu_spans(events) == {"forward": 8.5, "draw": 0.25}
    trace = RoundTrace(Path("unused"))
    trace.gpu_mark("cpu", torch.device("cpu"))  # no events off CUDA
    assert trace.events == []


def test_a_rounds_line_waits_in_order_until_the_gpu_has_passed_its_last_point(tmp_path):
    """The host never waits for the GPU to write a line: a round still running is written by a later write."""
    path, late = tmp_path / "rank0.trace", Event(5.0, passed=False)
    trace = RoundTrace(path)
    first, second = [("start", Event(1.0)), ("draw", Event(2.0))], [("start", Event(3.0)), ("draw", late)]
    rounds = {1: first, 2: second, 3: [], 4: []}
    for lanes, events in rounds.items():
        trace.start()
        trace.events = events
        trace.note(lanes=lanes)
        if lanes == 4:
            late.passed = True
        trace.write()
        written = [json.loads(line) for line in path.read_text().splitlines()]
        assert [line["lanes"] for line in written] == ([1] if lanes < 4 else [1, 2, 3, 4])
    assert written[0]["gpu"] == {"draw": 1.0} and written[1]["gpu"] == {"draw": 2.0} and "gpu" not in written[2]


def test_profile_pdl_gluon_and_overlap_settings_are_parsed_and_refused_by_name():
    good = {"FLASHNEXT_ROUND_PROFILE": "64", "FLASHNEXT_PDL": "0", "FLASHNEXT_PDL_PREFETCH": "1"}
    env = read_environment({**good, "FLASHNEXT_GLUON": "0", "FLASHNEXT_OVERLAP": "moe,qsa"})
    assert env.round_profile == 64
    bad = (("FLASHNEXT_ROUND_PROFILE", "0"), ("FLASHNEXT_PDL", "off"), ("FLASHNEXT_GLUON", "no"),
           ("FLASHNEXT_OVERLAP", "moe,shared"), ("FLASHNEXT_OVERLAP", ","))  # fmt: skip
    for name, value in bad:
        with pytest.raises(ValueError, match=name):
            read_environment({name: value})


def test_the_profile_covers_five_rounds_after_the_first_with_enough_lanes(tmp_path):
    trace = RoundTrace(tmp_path / "rank0.trace", profile_lanes=4)
    profiled = []
    for lanes in (1, 2, 4, 1, 4, 4, 4, 4, 4, 4):
        trace.start()
        profiled.append(trace.profiler is not None)
        torch.ones(8).add_(1)  # a host call for the profile to see
        trace.note(lanes=lanes)
        trace.write()
    assert profiled == [False, False, False, True, True, True, True, True, False, False]
    table = (tmp_path / "rank0.profile.txt").read_text()
    assert table.startswith("kernels per round over 5 rounds from the first of 4+ lanes")
    host = table.split("host calls per round by self time")[1].splitlines()[1:]
    assert any(line.endswith("1.0 calls  aten::add_") for line in host)
    assert len((tmp_path / "rank0.trace").read_text().splitlines()) == 10


def test_each_round_counts_the_pinned_blocks_made_during_it(tmp_path, monkeypatch):
    """The caching host allocator grows its pool when the blocks it holds still wait on their copies; a round's line
    says how many blocks it made and the time spent making them."""
    made = iter([
        {"num_host_alloc": 1, "host_alloc_time": {"total": 50.0}},
        {"num_host_alloc": 4, "host_alloc_time": {"total": 300.0}},
        {"num_host_alloc": 4, "host_alloc_time": {"total": 300.0}},
    ])  # fmt: skip
    monkeypatch.setattr(torch.cuda, "host_memory_stats_as_nested_dict", lambda: next(made))
    trace = RoundTrace(tmp_path / "rank0.trace")
    for _ in range(2):
        trace.start()
        trace.write()
    first, second = (json.loads(line) for line in (tmp_path / "rank0.trace").read_text().splitlines())
    assert (first["pinned_blocks_made"], first["pinned_alloc_ms"]) == (3, 0.25)
    assert (second["pinned_blocks_made"], second["pinned_alloc_ms"]) == (0, 0.0)


def test_pinned_blocks_made_before_the_first_round_are_not_its_own(tmp_path, monkeypatch):
    """The runner's trace is made before the server's start-up work (the lane pool, the graphs' capture), which may
    make pinned blocks: the first round's line counts only those made from its start on."""
    made = {"num_host_alloc": 1, "host_alloc_time": {"total": 50.0}}
    monkeypatch.setattr(torch.cuda, "host_memory_stats_as_nested_dict", lambda: made)
    trace = RoundTrace(tmp_path / "rank0.trace")
    made = {"num_host_alloc": 6, "host_alloc_time": {"total": 900.0}}  # start-up, after the trace was made
    trace.start()
    made = {"num_host_alloc": 8, "host_alloc_time": {"total": 1150.0}}  # the round's own
    trace.write()
    line = json.loads((tmp_path / "rank0.trace").read_text())
    assert (line["pinned_blocks_made"], line["pinned_alloc_ms"]) == (2, 0.25)


def test_summary_adds_up_the_pinned_blocks_each_kind_made():
    lines = [{"lanes": 1, "rows": 1, "phases": {"forward": 0.001}, "pinned_blocks_made": n} for n in (2, 0, 1)]
    lines.append({"lanes": 2, "rows": 2, "phases": {"forward": 0.001}})  # a line from before the count
    assert [e["pinned_blocks_made"] for e in summary.summarise(lines)] == [3, 0]


def _host_step() -> int:
    """A function of the round's own for Python's profile to see."""
    return sum(range(100))


def test_python_profile_covers_twenty_rounds_after_the_first_with_enough_lanes(tmp_path):
    trace = RoundTrace(tmp_path / "rank0.trace", pyprofile_lanes=2)
    profiled = []
    for lanes in (1, 2, *[1] * 21):
        trace.start()
        profiled.append(trace.pyprofiler is not None)
        _host_step()
        trace.note(lanes=lanes)
        trace.write()
    assert profiled == [False, False, *[True] * RoundTrace.PY_PROFILED_ROUNDS, False]
    table = (tmp_path / "rank0.pyprofile.txt").read_text()
    by_own, by_cumulative = table.split("Python functions by cumulative time")
    assert by_own.startswith("Python functions by own time per round over 20 rounds from the first of 2+ lanes:")
    ours = [line for line in by_cumulative.splitlines() if line.endswith("(_host_step)")]
    assert len(ours) == 1 and "server/test_round_trace.py:" in ours[0] and " 1.0 calls  " in ours[0]


def test_python_profile_waits_for_the_torch_profile(tmp_path):
    trace = RoundTrace(tmp_path / "rank0.trace", profile_lanes=1, pyprofile_lanes=1)
    running = []
    for _ in range(1 + RoundTrace.PROFILED_ROUNDS + RoundTrace.PY_PROFILED_ROUNDS):
        trace.start()
        running.append((trace.profiler is not None, trace.pyprofiler is not None))
        trace.note(lanes=1)
        trace.write()
    torch_rounds, py_rounds = RoundTrace.PROFILED_ROUNDS, RoundTrace.PY_PROFILED_ROUNDS
    assert running == [(False, False), *[(True, False)] * torch_rounds, *[(False, True)] * py_rounds]
    assert (tmp_path / "rank0.profile.txt").exists() and (tmp_path / "rank0.pyprofile.txt").exists()


def test_python_profile_setting_is_parsed_and_refused_by_name():
    assert read_environment({"FLASHNEXT_ROUND_PYPROFILE": "8"}).round_pyprofile == 8
    with pytest.raises(ValueError, match="FLASHNEXT_ROUND_PYPROFILE"):
        read_environment({"FLASHNEXT_ROUND_PYPROFILE": "-1"})


def test_a_profile_asked_for_without_a_trace_is_warned_of(tmp_path, caplog):
    """The profiles are written beside the trace's file: without FLASHNEXT_ROUND_TRACE the setting did nothing, and
    said nothing."""
    model = load_model(checkpoint(tmp_path / "m"), dtype="float32")
    for name in ("FLASHNEXT_ROUND_PROFILE", "FLASHNEXT_ROUND_PYPROFILE"):
        caplog.clear()
        rank_runner(model, 1, 0, read_environment({name: "1"}))
        assert "without one, nothing" in caplog.text
    caplog.clear()
    rank_runner(model, 1, 0, read_environment({"FLASHNEXT_ROUND_TRACE": str(tmp_path), "FLASHNEXT_ROUND_PROFILE": "1"}))
    assert "without one" not in caplog.text
