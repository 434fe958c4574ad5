"""scripts/bench_masks.py: a synthetic vocabulary like a byte-level BPE's, and each case's mask over it."""

from __future__ import annotations

import json

import bench_masks  # scripts/ is on the path (tests/conftest.py)


def test_the_synthetic_vocabulary_holds_every_byte_then_distinct_pieces():
    pieces = bench_masks.synthetic_pieces(3000, 0)
    assert pieces[:256] == [bytes([b]) for b in range(256)]
    assert len(pieces) == len(set(pieces)) == 3000 and all(2 <= len(p) <= 13 for p in pieces[256:])
    assert pieces == bench_masks.synthetic_pieces(3000, 0) != bench_masks.synthetic_pieces(3000, 1)


def test_each_case_reports_the_ids_its_grammar_allows(capsys):
    assert bench_masks.main(["--vocab", "3000"]) == 0
    results = {r["case"]: r for r in json.loads(capsys.readouterr().out.splitlines()[-1])}
    assert list(results) == [name for name, _, _ in bench_masks.CASES]
    pieces = bench_masks.synthetic_pieces(3000, 0)
    for name, grammar, text in bench_masks.CASES:  # each count against feeding every piece after the text
        state = grammar.feed(grammar.initial, text)
        assert results[name]["allowed"] == sum(grammar.feed(state, piece) is not None for piece in pieces), name
    assert all(r["allowed"] > 0 and r["first_ms"] >= r["cached_ms"] >= 0 for r in results.values())


def test_each_run_is_timed_over_its_steps(capsys):
    assert bench_masks.main(["--vocab", "3000", "--steps", "30"]) == 0
    runs = json.loads(capsys.readouterr().out.splitlines()[-2])
    assert [r["run"] for r in runs] == [name for name, _, _ in bench_masks.RUNS]
    assert all(r["states"] == 30 and r["total_ms"] >= r["slowest_ms"] > 0 for r in runs)
