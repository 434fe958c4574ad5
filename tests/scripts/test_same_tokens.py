"""scripts/same_tokens.py: every stream's token_sha compared across the bench outputs in a folder, by (level, rep)."""

from __future__ import annotations

import json
from pathlib import Path

import same_tokens  # scripts/ is on the path (tests/conftest.py)


def write_out(path: Path, shas_by_rep: list[list[str]]) -> None:
    """A bench_concurrent `--json` output: its report lines, then the JSON line of every run's streams."""
    runs = [{"rep": rep, "streams": [{"token_sha": sha} for sha in shas]} for rep, shas in enumerate(shas_by_rep, 1)]
    path.write_text("T=0 drafts off N=2: aggregate 1.0 tok/s\n" + json.dumps({"runs": runs}) + "\n")


def test_equal_outputs_pass_and_one_differing_stream_fails(tmp_path, capsys):
    for name in ("real_1_on_2", "real_2_off_2", "after_real_1_off_2"):
        write_out(tmp_path / f"{name}.out", [["a", "b"], ["c", "d"]])
    (tmp_path / "real_3_on_2.out").write_text("Traceback: the bench failed\n")  # no JSON line: left out
    assert same_tokens.main([str(tmp_path), "--what", "trees"]) == 0
    assert capsys.readouterr().out.strip() == "token_sha across trees: 2 (level, rep) cells, all equal"
    write_out(tmp_path / "before_real_1_off_2.out", [["a", "b"], ["c", "x"]])
    assert same_tokens.main([str(tmp_path)]) == 1
    assert capsys.readouterr().out.strip() == "token_sha across modes: 2 (level, rep) cells, DIFFERENT"


def test_levels_are_compared_apart(tmp_path):
    write_out(tmp_path / "real_1_on_1.out", [["a"]])
    write_out(tmp_path / "real_1_on_2.out", [["b", "c"]])
    assert same_tokens.token_shas(tmp_path) == {("1", 1): {"real_1_on_1": ["a"]}, ("2", 1): {"real_1_on_2": ["b", "c"]}}
