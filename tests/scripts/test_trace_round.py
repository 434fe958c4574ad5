"""scripts/trace_round.py on a made-up trace: replays by correlation, the kernels by the time they close, the linear
kernel by grid, QSA's join wait, the MoE's gate-up beside other streams and its one-row chain, and chains asked for."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import trace_round


def kernel(name: str, ts: float, dur: float, stream: int, correlation: int, grid=(1, 1, 1)) -> dict:
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur,
            "args": {"stream": stream, "correlation": correlation, "grid": list(grid)}}  # fmt: skip


def replay(correlation: int, t0: float) -> list[dict]:
    """One replay: a fused linear forks at t0 + 10; the index path (stream 2) ends 25 µs later, the main stream's
    kernels (stream 1) 8 µs later; then the attention."""
    return [
        {"name": "cudaGraphLaunch", "cat": "cuda_runtime", "ts": t0, "args": {"correlation": correlation}},
        kernel("_linear_kernel", t0, 10, 1, correlation, (1, 228, 1)),
        kernel("_norm_rope_kernel", t0 + 10, 8, 1, correlation),
        kernel("_index_score_kernel", t0 + 11, 4, 2, correlation),
        kernel("_index_write_kernel", t0 + 16, 19, 2, correlation),
        kernel("_attn_chunk_kernel", t0 + 35, 5, 2, correlation),
        kernel("_linear_kernel", t0 + 40, 6, 2, correlation, (1, 80, 4)),
    ]


def test_rounds_linear_grids_and_the_qsa_join(tmp_path: Path, capsys) -> None:
    events = replay(7, 0.0) + replay(9, 100.0) + [kernel("_linear_kernel", 300.0, 50, 1, 11)]  # an eager kernel
    rounds = trace_round.replays(events)
    assert [len(r) for r in rounds] == [6, 6]
    assert trace_round.linear_by_grid(rounds) == [((1, 228, 1), 1.0, 10), ((1, 80, 4), 1.0, 6)]
    assert trace_round.qsa_joins(rounds[0]) == [{"index": 25, "other": 8, "wait": 17}]
    closes = trace_round.closing(rounds, top=3)  # ends 10, 15, 18, 35, 40, 46: the write closes 18 -> 35
    assert closes == [("_index_write_kernel", (1, 1, 1), 1, 17), ("_linear_kernel", (1, 228, 1), 1, 10),
                      ("_linear_kernel", (1, 80, 4), 1, 6)]  # fmt: skip
    assert sum(us for *_, us in trace_round.closing(rounds, top=10)) == 46
    path = tmp_path / "step_trace.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    assert trace_round.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "2 replays: span 46.0 µs" in out and "17.0      1  _index_write_kernel [1, 1, 1]" in out
    assert "the attention waits 17.00 µs (2 of 2 windows wait)" in out


def test_a_trace_without_replays_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "eager.json"
    path.write_text(json.dumps({"traceEvents": [kernel("_linear_kernel", 0, 1, 1, 3)]}))
    with pytest.raises(SystemExit, match="no graph replay"):
        trace_round.main([str(path)])


def test_the_moe_gate_up_beside_other_streams_and_the_one_row_chain(tmp_path: Path, capsys) -> None:
    """A grouped gate-up's start against the other streams' earlier kernels, and a one-row layer's chain from the up
    kernel through the router's launch, the gate-up pairs and the down pairs kernels."""
    grouped = [
        {"name": "cudaGraphLaunch", "cat": "cuda_runtime", "ts": 0.0, "args": {"correlation": 3}},
        kernel("_linear_kernel", 0, 6, 2, 3),  # the shared expert on the side stream: ends at 6
        kernel("_gate_up_kernel", 4, 100, 1, 3),  # starts while it runs
        kernel("_linear_kernel", 104, 3, 2, 3),
        kernel("_gate_up_kernel", 110, 90, 1, 3),  # the side stream ended at 107
    ]
    assert trace_round.start_overlaps(trace_round.replays(grouped)[0], "_gate_up_kernel") == [(2, 100), (-3, 90)]
    one_row = [
        {"name": "cudaGraphLaunch", "cat": "cuda_runtime", "ts": 0.0, "args": {"correlation": 5}},
        kernel("_up_mix_kernel", 0, 10, 1, 5),
        kernel("_linear_kernel", 9, 6, 1, 5),  # the router's launch: ends at 15
        kernel("_linear_kernel", 10, 8, 2, 5),  # the shared expert's, on the side stream: not the router
        kernel("_gate_up_pairs_kernel", 14, 13, 1, 5),  # ends at 27, started before the router's end
        kernel("_down_pairs_kernel", 28, 7, 3, 5),  # ends at 35, started after the gate-up's end (another stream)
        kernel("_up_mix_kernel", 40, 10, 1, 5),  # a layer whose gate-up replays on the shared expert's stream
        kernel("_linear_kernel", 49, 6, 1, 5),  # the router's launch: ends at 55
        kernel("_linear_kernel", 50, 7, 2, 5),  # the shared expert's: ends at 57
        kernel("_gate_up_pairs_kernel", 56, 11, 2, 5),  # ends at 67
        kernel("_down_pairs_kernel", 60, 9, 2, 5),  # ends at 69, started beside the gate-up
    ]
    assert trace_round.pair_chains(trace_round.replays(one_row)[0]) == [
        {"gate_up": 12, "down": 8, "layer": 25, "gate_up_start": -1, "down_start": 1},
        {"gate_up": 12, "down": 2, "layer": 19, "gate_up_start": 1, "down_start": -7},
    ]
    path = tmp_path / "step_trace_64.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": grouped + one_row}).encode()))
    assert trace_round.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "grouped gate-up: 2 launches" in out and "before it starts: 90.00 (1), after: 100.00 (1)" in out
    assert "gate-up pairs kernel ends 12.00 µs after the router's launch, the down pairs kernel 5.00 µs" in out


def test_chains_from_a_kernels_end_need_every_name_before_its_next_launch(tmp_path: Path, capsys) -> None:
    """Ends after each start launch's end, the grid telling two launches of one kernel apart; a chain missing a name
    before the start's next launch is left out."""
    kernels = [
        kernel("_up_mix_kernel", 0, 10, 1, 5),
        kernel("_linear_kernel", 10, 3, 1, 5, (1, 80, 4)),  # another grid: not the one asked for
        kernel("_linear_kernel", 13, 2, 1, 5, (1, 32, 4)),
        kernel("_plan_kernel", 15, 5, 1, 5),
        kernel("_up_mix_kernel", 20, 10, 1, 5),
        kernel("_plan_kernel", 30, 4, 1, 5),  # no logits launch in this window
    ]
    chains = trace_round.chain_ends(kernels, "_up_mix_kernel", ["_linear_kernel[1,32,4]", "_plan_kernel"])
    assert chains == [{"_linear_kernel[1,32,4]": 5, "_plan_kernel": 10}]
    assert trace_round.kernel_spec("_linear_kernel[1, 32, 4]") == ("_linear_kernel", (1, 32, 4))
    events = [{"name": "cudaGraphLaunch", "cat": "cuda_runtime", "ts": 0.0, "args": {"correlation": 5}}, *kernels]
    path = tmp_path / "step_trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    assert trace_round.main([str(path), "--chain", "_up_mix_kernel", "_linear_kernel[1,32,4]", "_plan_kernel"]) == 0
    out = capsys.readouterr().out
    assert (
        "chain from _up_mix_kernel's end, 1 launches, medians µs: _linear_kernel[1,32,4] 5.00, _plan_kernel 10.00"
        in out
    )
