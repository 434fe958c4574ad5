"""scripts/bench_frontend.py's pure parts: flags, the round-time histogram and the summary math."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

from server.metrics import EngineMetrics

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_frontend.py"
spec = importlib.util.spec_from_file_location("bench_frontend", SCRIPT)
assert spec is not None and spec.loader is not None
bench = importlib.util.module_from_spec(spec)
sys.modules["bench_frontend"] = bench  # dataclasses look their module up there
spec.loader.exec_module(bench)


def test_flags_split_between_the_bench_and_the_server():
    args = bench.parse_args(
        ["configs/qwen3.8-flash-next", "--load-format", "dummy", "--clients", "4", "--tp", "2", "--device", "cuda"]
    )
    assert (args.clients, args.max_tokens, args.json) == (4, 256, None)
    assert args.server_args == ["configs/qwen3.8-flash-next", "--load-format", "dummy", "--tp", "2", "--device", "cuda"]
    assert (args.serve.tp, args.serve.load_format, str(args.serve.model)) == (2, "dummy", "configs/qwen3.8-flash-next")
    assert bench.parse_args([]).serve.model.name == "flashnext-small"
    with pytest.raises(SystemExit):
        bench.parse_args(["--lanes", "4"])  # neither the bench's flag nor the server's


def test_rounds_read_from_metrics_text_subtract_and_interpolate():
    metrics = EngineMetrics("m")
    for seconds in (0.010, 0.011, 0.012):
        metrics.round_seconds.observe(seconds)
    before = bench.read_rounds(metrics.render().decode())
    for seconds in (0.100, 0.100, 0.100, 0.200):
        metrics.round_seconds.observe(seconds)
    rounds = bench.read_rounds(metrics.render().decode()).minus(before)
    assert rounds.count == 4 and rounds.mean() == pytest.approx(0.125)
    # the median is two thirds of the way up the bucket that holds the three 0.1 s rounds
    i = next(i for i, bound in enumerate(rounds.bounds) if bound >= 0.1)
    lower, upper = rounds.bounds[i - 1], rounds.bounds[i]
    assert rounds.quantile(0.5) == pytest.approx(lower + (upper - lower) * 2 / 3)
    j = next(j for j, bound in enumerate(rounds.bounds) if bound >= 0.2)
    assert rounds.bounds[j - 1] < rounds.quantile(0.9) <= rounds.bounds[j]
    assert math.isnan(before.minus(before).mean())


def test_summary_and_shares():
    streams = [bench.Stream(4, 1.0, 3.0, "length"), bench.Stream(4, 2.0, 5.0, "length")]
    assert bench.aggregate_tok_s(streams) == pytest.approx(6 / 4)
    rounds = bench.Rounds((0.1, math.inf), (2.0, 2.0), 0.1, 2.0)
    engine = bench.summarize(rounds, streams, 4)
    assert (engine["rounds"], engine["round_mean_ms"], engine["tokens"]) == (2.0, pytest.approx(50.0), 8)
    http = {**engine, "round_mean_ms": 80.0, "round_total_s": 0.2}
    share = bench.shares(engine, http)
    assert share["front_end_share_of_mean_round"] == pytest.approx(0.375)
    assert share["front_end_share_of_total_round_time"] == pytest.approx(0.5)
    assert "37.5%" in bench.table(engine, http, share)
    with pytest.raises(RuntimeError, match="did not run to max_tokens"):
        bench.summarize(rounds, [*streams, bench.Stream(2, 1.0, 2.0, "stop")], 4)
