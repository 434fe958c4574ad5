"""scripts/gpu_torch_ops.py on the CPU under the Triton interpreter (the kernel path's tiny checkpoint)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import gpu_torch_ops
from make_checkpoint import make_checkpoint

from tests.tiny import KERNEL_TEXT, text_config


def test_lists_the_torch_ops_of_a_round_by_site(tmp_path, capsys) -> None:
    path = make_checkpoint(text_config("base", **KERNEL_TEXT), tmp_path / "bf16", fmt="bf16")
    assert gpu_torch_ops.main(["--model", str(path), "--device", "cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("torch ops in one lane's decode round, 3 layers")
    sites = [line.split(None, 1)[1] for line in lines[1:]]
    assert any(site.startswith("abs @ model/kernel_blocks.py") for site in sites)  # the PLE gate: torch ops
    assert not any(site.startswith(("view ", "empty ", "set_ ")) for site in sites)
    assert not any(site.startswith(("bitwise_xor ", "remainder ")) for site in sites)  # the n-gram hash: a kernel
