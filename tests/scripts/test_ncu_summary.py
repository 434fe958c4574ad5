"""scripts/ncu_summary.py over small exports in gpu_ncu.sh's two CSV layouts."""

from __future__ import annotations

from ncu_summary import main

HEAD = '"ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value"\n'
SASS_HEAD = '"Address","Source","Instructions Executed","stall_long_sb","stall_wait","stall_wait (Not Issued)"\n'


def details_csv() -> str:
    rows = [("0", "_a", "GPU Speed Of Light Throughput", "Duration", "ns", "10,208"),
            ("0", "_a", "Memory Workload Analysis", "Memory Throughput", "%", "21.25"),
            ("0", "_a", "Scheduler Statistics", "Issued Warp Per Scheduler", "", "0.37"),
            ("0", "_a", "Instruction Statistics", "Executed Instructions", "inst", "2,203,800"),
            ("1", "_b", "GPU Speed Of Light Throughput", "Duration", "ns", "3,936")]  # fmt: skip
    return HEAD + "".join(",".join(f'"{v}"' for v in row) + "\n" for row in rows)


def sass_csv(second: str = "_b") -> str:
    a = ['"0x0","      HMUL2.BF16_V2 R1, R2, R3","300","1","5","9"', '"0x10","  @P0 LOP3.LUT R4, R5","100","3","1","9"']
    b = ['"0x0","      LDG.E R1, [R2]","10","4","0","0"']
    return f'"Kernel Name","_a",\n{SASS_HEAD}' + "\n".join(a) + f'\n"Kernel Name","{second}",\n{SASS_HEAD}' + b[0]


def test_each_launch_gets_its_figures_stalls_and_instruction_mix(tmp_path, capsys) -> None:
    (tmp_path / "d.csv").write_text(details_csv())
    (tmp_path / "s.csv").write_text(sass_csv())
    assert main([str(tmp_path / "d.csv"), str(tmp_path / "s.csv"), "--top", "2"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "_a: time 10,208 ns, issued/cycle 0.37, instructions 2,203,800",
        "  stalls: wait 60%, long_sb 40%",
        "  instructions: HMUL2.BF16_V2 75%, LOP3.LUT 25%",
        "_b: time 3,936 ns",
        "  stalls: long_sb 100%",
        "  instructions: LDG.E 100%",
    ]


def test_exports_of_other_launches_are_refused(tmp_path, capsys) -> None:
    (tmp_path / "d.csv").write_text(details_csv())
    (tmp_path / "s.csv").write_text(sass_csv("_c"))
    assert main([str(tmp_path / "d.csv"), str(tmp_path / "s.csv")]) == 1
    assert "other launches" in capsys.readouterr().err
