"""GPU check of the NVFP4 grouped MoE at the per-rank shapes of tp=2 (E=512, d=2560, I=320, k=10): error against
the torch reference, row invariance (batches of 1, 2, 7 against 64, and prefill rows against the same rows alone),
and time (eager and CUDA-graph replay, cold L2) against the floor of touched expert bytes and activations.

python3 scripts/gpu_check_moe.py --out DIR            # writes DIR/moe.json and prints one line per case
python3 scripts/gpu_check_moe.py --out DIR --sweep --banks nvfp4,bf16   # other tile configs; the BF16 bank
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels import moe
from kernels.fp4_words import kernel_bank

BANDWIDTH = 4.27e12  # bytes/s, measured device-to-device copy on the project's H200s
MATMUL = 790e12  # FLOP/s, measured bf16 matrix product on the project's H200s
BATCHES = (1, 8, 64, 8192)
INVARIANCE_BATCHES = (1, 2, 7)
SWEEP = (
    moe.MoeTiles(16, 32, 256, 64, 64, 4, 4),
    moe.MoeTiles(16, 64, 256, 64, 64, 4, 3),
    moe.MoeTiles(16, 32, 128, 64, 64, 4, 4),
    moe.MoeTiles(16, 32, 256, 128, 64, 8, 3),
    moe.MoeTiles(16, 64, 128, 128, 64, 8, 3),
    moe.MoeTiles(32, 64, 128, 128, 64, 4, 3),
    moe.MoeTiles(64, 64, 128, 128, 64, 2, 3),
    moe.MoeTiles(32, 128, 128, 128, 64, 8, 3),
)


@dataclass(frozen=True)
class Shape:
    """Per-rank routed-expert widths at tp=2."""

    experts: int = 512
    hidden: int = 2560
    inter: int = 320
    top_k: int = 10

    def expert_bytes(self, fp4: bool) -> int:
        """Bytes of one expert's weights (and scales)."""
        elems = 3 * self.inter * self.hidden
        return elems // 2 + elems // 16 + 12 if fp4 else 2 * elems


def packed_bank(shape: Shape, gen: torch.Generator, device: str | torch.device = "cuda") -> dict[str, torch.Tensor]:
    """Random NVFP4 experts in the checkpoint's layout: uniform codes, e4m3 block scales between 1/8 and 8, scale_2
    near a checkpoint's."""
    e, d, i = shape.experts, shape.hidden, shape.inter

    def scales(*size: int) -> torch.Tensor:
        return torch.exp2(torch.rand(*size, device=device, generator=gen) * 6 - 3).to(torch.float8_e4m3fn)

    def codes(*size: int) -> torch.Tensor:
        return torch.randint(0, 256, size, device=device, generator=gen, dtype=torch.uint8)

    return {
        "gate_up_packed": codes(e, 2 * i, d // 2),
        "gate_up_scale": scales(e, 2 * i, d // 16),
        "gate_up_scale_2": torch.full((e, 2), 0.2 * d**-0.5, device=device),
        "down_packed": codes(e, d, i // 2),
        "down_scale": scales(e, d, i // 16),
        "down_scale_2": torch.full((e,), 0.2 * i**-0.5, device=device),
    }


def make_bank(shape: Shape, fp4: bool, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random weights on the GPU: `packed_bank` in the kernels' word layout, or BF16 experts."""
    e, d, i = shape.experts, shape.hidden, shape.inter
    if not fp4:
        return {
            "gate_up": (torch.randn(e, 2 * i, d, device="cuda", generator=gen) * d**-0.5).bfloat16(),
            "down": (torch.randn(e, d, i, device="cuda", generator=gen) * i**-0.5).bfloat16(),
        }
    return kernel_bank(packed_bank(shape, gen), in_place=True)


def make_routing(shape: Shape, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x [n, d] bf16, distinct expert ids [n, k] int32 in random slot order, renormalised fp32 weights)."""
    x = torch.randn(n, shape.hidden, device="cuda", generator=gen).bfloat16()
    scores = torch.rand(n, shape.experts, device="cuda", generator=gen)
    ids = scores.topk(shape.top_k, dim=-1).indices
    ids = ids.gather(1, torch.rand(ids.shape, device="cuda", generator=gen).argsort(dim=1)).to(torch.int32)
    w = torch.rand(n, shape.top_k, device="cuda", generator=gen) + 0.05
    return x, ids, w / w.sum(-1, keepdim=True)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64."""
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def floor_us(shape: Shape, ids: torch.Tensor, fp4: bool) -> tuple[float, float]:
    """(byte floor, FLOP floor) in µs: touched experts' bytes plus activations; 2·N·k·3·d·I FLOPs."""
    n = ids.shape[0]
    touched = int(torch.unique(ids).numel())
    acts = n * shape.hidden * 2 * 2 + ids.numel() * 8
    flops = 2 * n * shape.top_k * 3 * shape.hidden * shape.inter
    return (touched * shape.expert_bytes(fp4) + acts) / BANDWIDTH * 1e6, flops / MATMUL * 1e6


def time_eager(fn: Callable[[int], object], sets: int, iters: int, flush: torch.Tensor) -> float:
    """Median µs of fn(i % sets) between CUDA events, L2 flushed before each run."""
    for i in range(3):
        fn(i % sets)
    times = []
    for i in range(iters):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(i % sets)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def time_graph(
    run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    inputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    iters: int,
    flush: torch.Tensor,
) -> float:
    """Median µs of one CUDA-graph replay, new routing copied into the static inputs and L2 flushed before each."""
    static = [t.clone() for t in inputs[0]]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            run(*static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(*static)
    times = []
    for i in range(iters + 3):
        for dst, src in zip(static, inputs[i % len(inputs)], strict=True):
            dst.copy_(src)
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def row_invariance(bank: dict[str, torch.Tensor], x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> dict:
    """Rows of the batch against the same rows in batches of 1, 2 and 7: bit-identical or not, per batch size."""
    full = moe.moe_forward(x, ids, w, bank)
    result = {}
    for b in INVARIANCE_BATCHES:
        same = True
        for i in range(0, x.shape[0] - b + 1, b):
            part = moe.moe_forward(x[i : i + b], ids[i : i + b], w[i : i + b], bank)
            same &= torch.equal(part, full[i : i + b])
        result[str(b)] = same
    return result


def mma_kinds() -> dict[str, list[str]]:
    """Which tensor-core instructions each compiled GEMM kernel uses (wgmma would break the invariance argument)."""
    kinds: dict[str, list[str]] = {}
    for name in ("_gate_up_kernel", "_down_kernel", "_gate_up_pairs_kernel", "_down_pairs_kernel"):
        found = set()
        for cache in getattr(moe, name).device_caches.values():
            for kernel in cache[0].values():
                ptx = kernel.asm.get("ptx", "")
                found |= {k for k in ("wgmma", "mma.sync") if k in ptx}
        kinds[name] = sorted(found)
    return kinds


def check_case(shape: Shape, bank: dict, fp4: bool, n: int, args: argparse.Namespace, flush: torch.Tensor) -> dict:
    """Error, invariance and time of one batch size."""
    gen = torch.Generator(device="cuda").manual_seed(1000 + n)
    sets = [make_routing(shape, n, gen) for _ in range(args.sets if n <= 64 else 2)]
    x, ids, w = sets[0]
    out = moe.moe_forward(x, ids, w, bank)
    ref = moe.moe_forward_reference(x, ids, w, bank)
    case: dict = {"n": n, "bank": "nvfp4" if fp4 else "bf16", "rel_err": rel_err(out, ref)}
    case["nan"] = bool(out.isnan().any())
    if n == 64:
        case["row_invariant"] = row_invariance(bank, x, ids, w)
    elif n > 64:
        rows = range(0, n, n // 16)
        case["row_invariant"] = {
            "1": all(
                torch.equal(moe.moe_forward(x[r : r + 1], ids[r : r + 1], w[r : r + 1], bank)[0], out[r]) for r in rows
            )
        }
    byte_floor, flop_floor = floor_us(shape, ids, fp4)
    case["floor_us"] = max(byte_floor, flop_floor if n > 64 else 0.0)
    case["byte_floor_us"], case["flop_floor_us"] = byte_floor, flop_floor
    case["eager_us"] = time_eager(lambda i: moe.moe_forward(*sets[i], bank), len(sets), args.iters, flush)
    case["time_us"] = time_graph(lambda a, b, c: moe.moe_forward(a, b, c, bank), sets, args.iters, flush)
    case["ratio"] = case["time_us"] / case["floor_us"]
    if args.sweep:
        case["sweep"] = []
        for tiles in SWEEP:
            entry = {"tiles": asdict(tiles)}
            try:
                entry["same_bits"] = torch.equal(moe.moe_forward(x, ids, w, bank, tiles=tiles), out)
                entry["time_us"] = time_graph(
                    lambda a, b, c, t=tiles: moe.moe_forward(a, b, c, bank, tiles=t), sets, args.iters, flush
                )
            except Exception as exc:  # a config that does not compile or fit is reported, not fatal
                entry["error"] = repr(exc)
            case["sweep"].append(entry)
    return case


def main(argv: list[str] | None = None) -> int:
    """Run every case, write DIR/moe.json, print one line per case; 0 when all pass, 1 otherwise."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batches", type=lambda s: [int(v) for v in s.split(",")], default=list(BATCHES))
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--sets", type=int, default=8, help="routings cycled through while timing decode batches")
    parser.add_argument("--banks", default="nvfp4", help="comma-separated banks to check: nvfp4, bf16")
    parser.add_argument("--sweep", action="store_true", help="also time the other tile configs")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {"cases": [], "device": None}
    if not torch.cuda.is_available():
        report["error"] = "no CUDA device"
        (args.out / "moe.json").write_text(json.dumps(report, indent=2))
        print("no CUDA device: nothing checked")
        return 1
    report["device"] = torch.cuda.get_device_name()
    shape = Shape()
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    ok = True
    for fp4 in [name == "nvfp4" for name in args.banks.split(",")]:
        bank = make_bank(shape, fp4, gen)
        for n in args.batches:
            try:
                case = check_case(shape, bank, fp4, n, args, flush)
            except Exception:
                case = {"n": n, "bank": "nvfp4" if fp4 else "bf16", "error": traceback.format_exc()}
            report["cases"].append(case)
            if "error" in case:
                ok = False
                print(f"N={n:5d} {case['bank']}: ERROR {case['error'].splitlines()[-1]}")
                continue
            invariant = all(case.get("row_invariant", {"-": True}).values())
            ok &= invariant and not case["nan"] and case["rel_err"] <= 1e-2
            print(
                f"N={n:5d} E={shape.experts} d={shape.hidden} I={shape.inter} k={shape.top_k} {case['bank']}: "
                f"time_us={case['time_us']:.1f} eager_us={case['eager_us']:.1f} floor_us={case['floor_us']:.1f} "
                f"ratio={case['ratio']:.2f} rel_err={case['rel_err']:.2e} row_invariant={case.get('row_invariant')}"
            )
            for entry in case.get("sweep", []):
                print(f"    {entry}")
        del bank
    try:
        report["mma"] = mma_kinds()
    except Exception as exc:
        report["mma"] = repr(exc)
    print(f"mma instructions: {report['mma']}")
    (args.out / "moe.json").write_text(json.dumps(report, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
