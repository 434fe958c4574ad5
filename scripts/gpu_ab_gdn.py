"""The GDN recurrence now against an earlier copy of kernels/gdn.py on one GPU: bits of every output, final state and
kept state, and the time per call (CUDA-graph replays) of each, both forms (`long_runs`) of the current one.

git show REV:kernels/gdn.py > /tmp/gdn_before.py
python3 scripts/gpu_ab_gdn.py --before /tmp/gdn_before.py        # tp=2's per-rank widths, one H200
TRITON_INTERPRET=1 python3 scripts/gpu_ab_gdn.py --before FILE --smoke   # tiny shapes on the CPU, untimed
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]

from gpu_timing import graph_median_us  # noqa: E402

from kernels import gdn  # noqa: E402

REAL = (24, 8, 128)  # value heads, key heads, Dk = Dv
SMOKE = (4, 2, 16)
CASES = {  # name: (rows of each lane, keep every row's state)
    "decode 1": ((1,), False),
    "decode 8": ((1,) * 8, False),
    "decode 64": ((1,) * 64, False),
    "verify 64x4": ((4,) * 64, True),
    "mixed": ((1, 37, 1, 200, 3, 1, 64, 129), True),
    "prompt 1024": ((1024,), False),
    "prompt 8192": ((8192,), False),
}
SMOKE_CASES = {"decode 3": ((1, 1, 1), False), "mixed": ((1, 20, 3), True)}


def load(path: Path) -> ModuleType:
    """A kernels/gdn.py copy as a module of its own."""
    spec = importlib.util.spec_from_file_location("gdn_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def inputs(widths: tuple[int, int, int], lens: tuple[int, ...], device: torch.device) -> dict[str, torch.Tensor]:
    """q, k, v as views of one post-conv buffer, g, beta and a state per lane (seed 7)."""
    heads, key_heads, dim = widths
    gen = torch.Generator(device=device).manual_seed(7)
    seq, qk = sum(lens), key_heads * dim
    qkv = F.silu(torch.randn(seq, 2 * qk + heads * dim, generator=gen, device=device)).bfloat16()
    return {
        "q": qkv[:, :qk].view(seq, key_heads, dim),
        "k": qkv[:, qk : 2 * qk].view(seq, key_heads, dim),
        "v": qkv[:, 2 * qk :].view(seq, heads, dim),
        "g": -F.softplus(torch.randn(seq, heads, generator=gen, device=device) + 1.0) * 0.5,
        "beta": torch.sigmoid(torch.randn(seq, heads, generator=gen, device=device)),
        "state": 0.1 * torch.randn(len(lens), heads, dim, dim, generator=gen, device=device),
    }


def call(module: ModuleType, data: dict[str, torch.Tensor], lanes: torch.Tensor, keep: bool, state, **kw):
    """One gdn_recurrent call of `module` on `state` (updated in place); (out, kept states)."""
    args = (data["q"], data["k"], data["v"], data["g"], data["beta"], state, lanes)
    return module.gdn_recurrent(*args, keep_states=keep, **kw)


def compare(before: ModuleType, widths, cases, device: torch.device, timed: bool) -> list[dict[str, object]]:
    """Per case: whether every variant's bits equal the earlier copy's, and each variant's µs per call."""
    variants = {"before": (before, {}), "now": (gdn, {}), "now long_runs": (gdn, {"long_runs": True})}
    rows = []
    for name, (lens, keep) in cases.items():
        data = inputs(widths, lens, device)
        lanes = torch.repeat_interleave(torch.arange(len(lens), device=device), torch.tensor(lens, device=device))
        lanes = lanes.int()
        results, times = {}, {}
        for label, (module, kw) in variants.items():
            state = data["state"].clone()
            out, kept = call(module, data, lanes, keep, state, **kw)
            results[label] = (out, state, kept)
            if timed:
                step = functools.partial(call, module, data, lanes, keep, data["state"].clone(), **kw)
                times[label] = graph_median_us([step], 10, 25)
        ref = results["before"]
        equal = all(
            all((a is None and b is None) or torch.equal(a, b) for a, b in zip(ref, got, strict=True))
            for got in results.values()
        )
        rows.append({"case": name, "bits_equal": equal, "us": times})
        print(f"{name:12s} bits equal {equal}  " + "  ".join(f"{k} {v:8.1f} us" for k, v in times.items()), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, required=True, help="an earlier copy of kernels/gdn.py")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under the Triton interpreter")
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.smoke else "cuda")
    widths, cases = (SMOKE, SMOKE_CASES) if args.smoke else (REAL, CASES)
    rows = compare(load(args.before), widths, cases, device, timed=not args.smoke)
    return 0 if all(row["bits_equal"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
