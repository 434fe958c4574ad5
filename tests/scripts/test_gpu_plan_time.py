"""scripts/gpu_plan_time.py on the CPU under the Triton interpreter (tiny shapes, untimed)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import gpu_plan_time

from kernels import moe


def test_the_plan_equals_the_reference(capsys) -> None:
    assert gpu_plan_time.main(["--smoke"]) == 0
    assert capsys.readouterr().out.count("equal True") == len(gpu_plan_time.SMOKE_ROWS)


def test_a_plan_that_differs_is_reported(monkeypatch) -> None:
    def shifted(ids, experts, block_m):
        plan = moe.moe_plan_reference(ids, experts, block_m)
        return plan.__class__(
            plan.pairs.roll(1),
            *(getattr(plan, f) for f in ("bounds", "tile_experts", "tile_starts", "block_m", "max_tiles")),
        )

    monkeypatch.setattr(gpu_plan_time, "moe_plan", shifted)
    assert gpu_plan_time.main(["--smoke"]) == 1
