"""The routed MoE now against an earlier copy of kernels/moe.py on one GPU: bits of the fp32 and bf16 outputs on the
same random NVFP4 experts and routings, and the time per call of each (CUDA-graph replays, weights cold in L2).
`--after FILE` puts another copy in place of the current kernels.

git show REV:kernels/moe.py > /tmp/moe_before.py
python3 scripts/gpu_ab_moe.py --before /tmp/moe_before.py [--rows 1 8 64 1024]   # tp=2's per-rank widths, one H200
TRITON_INTERPRET=1 python3 scripts/gpu_ab_moe.py --before FILE --smoke            # tiny shapes on the CPU, untimed

A copy that predates the word layout (its FP4 keys name `*_packed` codes) is given the checkpoint-layout bank, one
that predates the spans (kernels/fp4_words.py) the words without them, a later one the bank `kernel_bank` makes.
Besides the elements with other bits, each row count reports
||now - before|| / ||before|| of the fp32 outputs.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]

from gpu_check_moe import Shape, packed_bank  # noqa: E402
from gpu_timing import graph_median_us  # noqa: E402

from kernels import moe  # noqa: E402
from kernels.fp4_words import PACKED_KEYS, kernel_bank, to_words  # noqa: E402

REAL = (512, 2560, 320, 10)  # experts, d, I per rank, top-k
SMOKE = (8, 64, 32, 2)
ROWS = (1, 8, 64, 1024)
SMOKE_ROWS = (1, 5)
SETS = 32  # routing sets a timed graph cycles through: enough experts, even at one row, to overflow L2
REPLAYS = 25

Bank = dict[str, torch.Tensor]
Routing = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def load(path: Path, name: str) -> ModuleType:
    """A kernels/moe.py copy as a module of its own."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def routings(shape: tuple[int, int, int, int], n: int, count: int, device: torch.device) -> list[Routing]:
    """`count` seeded sets of (x [n, d] bf16, distinct expert ids [n, k] in random order, renormalised weights)."""
    e, d, _, k = shape
    gen = torch.Generator(device=device).manual_seed(n)
    sets = []
    for _ in range(count):
        x = torch.randn(n, d, device=device, generator=gen).bfloat16()
        ids = torch.rand(n, e, device=device, generator=gen).argsort(dim=1)[:, :k].to(torch.int32)
        w = torch.rand(n, k, device=device, generator=gen) + 0.05
        sets.append((x, ids, w / w.sum(-1, keepdim=True)))
    return sets


def bank_for(module: ModuleType, packed: Bank) -> Bank:
    """The bank as `module` takes it: the word layout with spans if it reads them, without them if it predates them
    (no `_k_tile`), else the checkpoint's."""
    if "gate_up_words" not in module.FP4_KEYS:
        return packed
    if hasattr(module, "_k_tile"):
        return kernel_bank(packed)
    words = {key.replace("_packed", "_words"): to_words(packed[key]) for key in PACKED_KEYS}
    return {**{key: value for key, value in packed.items() if key not in PACKED_KEYS}, **words}


def compare(
    before: ModuleType, after: ModuleType, shape, rows, device: torch.device, timed: bool
) -> list[dict[str, object]]:
    """Per row count: fp32 and bf16 elements whose bits differ from the earlier copy's, and each copy's µs per call."""
    packed = packed_bank(Shape(*shape), torch.Generator(device=device).manual_seed(0), device)
    modules = {"before": before, "now": after}
    banks = {label: bank_for(module, packed) for label, module in modules.items()}
    results = []
    for n in rows:
        sets = routings(shape, n, SETS if timed else 1, device)
        outs = {
            label: [(m.moe_forward(*r, banks[label], torch.float32), m.moe_forward(*r, banks[label])) for r in sets]
            for label, m in modules.items()
        }
        differ = [
            sum(int((a.view(torch.int32) != b.view(torch.int32)).sum()) for a, b in zip(got, want, strict=True))
            for got, want in zip(outs["now"], outs["before"], strict=True)
        ]
        now32 = torch.stack([got[0] for got in outs["now"]]).double()
        before32 = torch.stack([want[0] for want in outs["before"]]).double()
        rel_diff = ((now32 - before32).norm() / before32.norm()).item()
        times = {}
        if timed:
            for label, m in modules.items():
                calls = [lambda r=r, m=m, b=banks[label]: m.moe_forward(*r, b) for r in sets]
                times[label] = graph_median_us(calls, len(calls), REPLAYS)
        row = {"rows": n, "elements_differing": sum(differ), "rel_diff": rel_diff, "us": times}
        results.append(row)
        print(
            f"rows {n:5d}  elements with other bits {sum(differ)}  rel. difference {rel_diff:.2e}  "
            + "  ".join(f"{k} {v:8.1f} us" for k, v in times.items()),
            flush=True,
        )
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, required=True, help="an earlier copy of kernels/moe.py")
    ap.add_argument("--after", type=Path, help="another copy in place of the current kernels/moe.py")
    ap.add_argument("--rows", type=int, nargs="+", help=f"batch sizes (default {ROWS})")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under the Triton interpreter")
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.smoke else "cuda")
    shape, rows = (SMOKE, SMOKE_ROWS) if args.smoke else (REAL, ROWS)
    after = load(args.after, "moe_after") if args.after else moe
    results = compare(load(args.before, "moe_before"), after, shape, args.rows or rows, device, timed=not args.smoke)
    return 0 if all(row["elements_differing"] == 0 for row in results) else 1


if __name__ == "__main__":
    sys.exit(main())
