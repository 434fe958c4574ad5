"""scripts/gpu_ab_round.py with stand-in trees whose step profile writes known figures: the runs' order, the rows and
the table, a failed run, and the tree arguments refused."""

from __future__ import annotations

import json
from pathlib import Path

import gpu_ab_round
import pytest

FAKE_PROFILE = """
import json, sys
from pathlib import Path
args = sys.argv[1:]
out = Path(args[args.index("--out") + 1])
lanes = [int(a) for a in args[args.index("--lanes") + 1:]]
me = json.loads(Path("figures.json").read_text())
with open(me["log"], "a") as log:
    log.write(me["name"] + " " + " ".join(args) + "\\n")
if me.get("peek"):  # what the call has written so far
    with open(me["log"], "a") as log:
        log.write("seen " + (out.parent / "ab_round.json").read_text().replace("\\n", "") + "\\n")
if me.get("sleep"):
    print("started", flush=True)
    import time
    time.sleep(me["sleep"])
if me.get("silent"):
    sys.exit(0)
if me.get("old"):
    (out / "step_profile.json").write_text(json.dumps({"rows": []}))
    sys.exit(0)
if me.get("fail"):
    print("a failure the row keeps")
    sys.exit(3)
busy = {"1 lane": {"ms": me["plain"], "shares_ms": {}},
        "verify": {"ms": me["verify"], "shares_ms": {"_gated_norm_kernel": me["norm"]}}}
rows = [{"lanes": n, "replay_ms": me["replay"] * n} for n in lanes]
(out / "step_profile.json").write_text(json.dumps({"rows": rows, "busy": busy}))
"""


def fake_tree(root: Path, name: str, log: Path, **figures: float) -> Path:
    """A folder whose scripts/gpu_step_profile.py logs its call and writes `figures` as a profile would."""
    tree = root / name
    (tree / "scripts").mkdir(parents=True)
    (tree / "scripts" / "gpu_step_profile.py").write_text(FAKE_PROFILE)
    (tree / "figures.json").write_text(json.dumps({"name": name, "log": str(log), **figures}))
    return tree


def test_trees_run_in_turn_and_each_row_has_its_runs_figures(tmp_path: Path, capsys) -> None:
    log = tmp_path / "calls.log"
    base = fake_tree(tmp_path, "base", log, plain=4.0, verify=5.4, norm=0.2, replay=4.3)
    new = fake_tree(tmp_path, "new", log, plain=4.0, verify=5.2, norm=0.1, replay=4.2)
    out = tmp_path / "out"
    argv = ["--out", str(out), "--tree", f"base={base}", "--tree", f"new={new}", "--lanes", "1", "64",
            "--kernels", "_gated_norm_kernel", "_combine_kernel"]  # fmt: skip
    assert gpu_ab_round.main(argv) == 0
    calls = log.read_text().splitlines()
    assert [c.split()[0] for c in calls] == ["base", "new", "base", "new"]
    assert all("--alone-as 2" in c and c.endswith("--lanes 1 64") for c in calls)
    rows = json.loads((out / "ab_round.json").read_text())
    assert [(r["tree"], r["turn"]) for r in rows] == [("base", 1), ("new", 1), ("base", 2), ("new", 2)]
    assert rows[1]["replay_ms"] == {"1": 4.2, "64": pytest.approx(4.2 * 64)}
    assert rows[1]["ratio"] == pytest.approx(1.3) and rows[0]["ratio"] == pytest.approx(1.35)
    assert rows[1]["verify_shares_ms"] == {"_gated_norm_kernel": 0.1, "_combine_kernel": None}
    lines = capsys.readouterr().out.splitlines()
    assert "| new | 1 | 4.200 | 268.800 | 4.000 | 5.200 | 1.300 | 0.100 | — |" in lines
    assert (out / "new_2" / "step_profile.json").is_file()


def test_a_failed_run_is_a_row_with_its_error_and_fails_the_call(tmp_path: Path, capsys) -> None:
    log = tmp_path / "calls.log"
    good = fake_tree(tmp_path, "good", log, plain=4.0, verify=5.2, norm=0.1, replay=4.2)
    bad = fake_tree(tmp_path, "bad", log, fail=1)
    out = tmp_path / "out"
    assert gpu_ab_round.main(["--out", str(out), "--tree", f"good={good}", "--tree", f"bad={bad}", "--turns", "1"]) == 1
    rows = json.loads((out / "ab_round.json").read_text())
    assert "ratio" in rows[0] and rows[1]["error"] == "exit status 3"
    assert rows[1]["log_tail"].strip() == "a failure the row keeps"
    assert "| bad | 1 | exit status 3: a failure the row keeps |" in capsys.readouterr().out


@pytest.mark.parametrize("spec", ["base", "=build/base", "base=", "x=does/not/exist"])
def test_a_tree_that_is_not_name_and_profiled_path_is_refused(spec: str, capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        gpu_ab_round.parse_args(["--out", "o", "--tree", spec])
    assert stop.value.code == 2 and "--tree" in capsys.readouterr().err


def test_a_tree_name_given_twice_is_refused(tmp_path: Path, capsys) -> None:
    tree = fake_tree(tmp_path, "t", tmp_path / "log", plain=1.0, verify=1.0, norm=0.0, replay=1.0)
    with pytest.raises(SystemExit):
        gpu_ab_round.parse_args(["--out", "o", "--tree", f"a={tree}", "--tree", f"a={tree}"])
    assert "given twice" in capsys.readouterr().err


def test_a_tree_whose_profile_keeps_no_busy_times_is_an_error_row(tmp_path: Path) -> None:
    old = fake_tree(tmp_path, "old", tmp_path / "calls.log", old=1)
    out = tmp_path / "out"
    assert gpu_ab_round.main(["--out", str(out), "--tree", f"old={old}", "--turns", "1"]) == 1
    assert "predates" in json.loads((out / "ab_round.json").read_text())[0]["error"]


def test_each_run_is_kept_before_the_next_starts(tmp_path: Path) -> None:
    log = tmp_path / "calls.log"
    first = fake_tree(tmp_path, "first", log, plain=4.0, verify=5.2, norm=0.1, replay=4.2)
    second = fake_tree(tmp_path, "second", log, peek=1, silent=1)
    argv = ["--out", str(tmp_path / "out"), "--tree", f"first={first}", "--tree", f"second={second}", "--turns", "1"]
    assert gpu_ab_round.main(argv) == 1
    seen = json.loads(log.read_text().splitlines()[-1].removeprefix("seen "))
    assert [row["tree"] for row in seen] == ["first"]


def test_a_run_that_writes_no_report_is_not_read_from_an_earlier_calls(tmp_path: Path) -> None:
    silent = fake_tree(tmp_path, "silent", tmp_path / "calls.log", silent=1)
    out = tmp_path / "out"
    (out / "silent_1").mkdir(parents=True)
    (out / "silent_1" / "step_profile.json").write_text(json.dumps({"rows": [], "busy": {}}))
    assert gpu_ab_round.main(["--out", str(out), "--tree", f"silent={silent}", "--turns", "1"]) == 1
    assert json.loads((out / "ab_round.json").read_text())[0]["error"] == "no step_profile.json written"


def test_a_run_past_its_timeout_keeps_what_it_printed(tmp_path: Path) -> None:
    slow = fake_tree(tmp_path, "slow", tmp_path / "calls.log", sleep=30)
    out = tmp_path / "out"
    assert gpu_ab_round.main(["--out", str(out), "--tree", f"slow={slow}", "--turns", "1", "--timeout", "2"]) == 1
    row = json.loads((out / "ab_round.json").read_text())[0]
    assert row["error"] == "timed out after 2 s" and "started" in row["log_tail"]
    assert "started" in (out / "slow_1" / "profile.log").read_text()
