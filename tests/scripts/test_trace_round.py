"""scripts/trace_round.py on a made-up trace: replays by correlation, the kernels by the time they close, the linear
kernel by grid, QSA's join wait."""

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
