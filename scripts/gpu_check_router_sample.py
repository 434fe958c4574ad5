"""Check the MoE router top-k and the batched keyed token draws on one GPU at the real shapes of tp=2.

python3 scripts/gpu_check_router_sample.py --out DIR      # writes DIR/router_sample.json, one line per case
TRITON_INTERPRET=1 python3 scripts/gpu_check_router_sample.py --out DIR --smoke   # tiny shapes on the CPU

Router (E = 512, k = 10, N = 1 ... 8192, bf16 and fp32 logits): ids identical to `router_topk_reference` row by
row (ids_mismatch counts the rows that differ), weights within 1e-6 (rel_err is ||w - ref|| / ||ref||), each row
bit-identical alone and at batch 2, 7, 64 and N. Sampling (V = 248320, N = 1 ... 64, fp32 and bf16 logits, several
parameter mixes): each row's token identical to `server.sampling.sample_token` on that row alone on the same GPU
(rel_err is the fraction of rows that differ), the probabilities bit-identical to sample_token's one-row softmax,
the tokens identical alone and at batch 2, 7 and 64. Time: the median over REPLAYS replays of a CUDA graph of CALLS
calls over rotating input copies (cold L2), per call; eager CUDA events where capture fails (softmax_sort_us times
the torch stage of sampling alone). Floor: the logits read once at 4.27 TB/s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kernels.router import router_topk, router_topk_reference  # noqa: E402
from kernels.sample import sample_rows, scaled_softmax  # noqa: E402
from server.sampling import sample_token  # noqa: E402

HBM_BYTES_PER_S = 4.27e12
COLD_BYTES = 300_000_000
CALLS = 20
REPLAYS = 25
EXPERTS, TOP_K, VOCAB = 512, 10, 248320
ROUTER_ROWS = (1, 2, 7, 64, 512, 8192)
SAMPLE_ROWS = (1, 2, 7, 64)
INVARIANCE_BATCHES = (2, 7, 64)
WEIGHT_TOL = 1e-6
# (temperature, top_k, top_p, min_p) per row, cycled: greedy, temperature only, each filter, all together
MIXES = {
    "mixed": ((0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (0.7, 20, 1.0, 0.0), (1.0, 0, 0.95, 0.0), (1.0, 0, 1.0, 0.05)),
    "all": ((0.8, 40, 0.9, 0.02),),
    "temperature": ((1.0, 0, 1.0, 0.0),),
    "top_p": ((1.0, 0, 0.95, 0.0),),
    "typical": ((1.0, 20, 0.95, 0.0),),
    "greedy": ((0.0, 0, 1.0, 0.0),),
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def router_cases(smoke: bool) -> list[tuple[int, int, int, str]]:
    """(N, E, k, logits dtype) per router case."""
    if smoke:
        return [(1, 64, 4, "bf16"), (7, 64, 4, "fp32")]
    return [(n, EXPERTS, TOP_K, "bf16") for n in ROUTER_ROWS] + [
        (64, EXPERTS, TOP_K, "fp32"),
        (8192, EXPERTS, TOP_K, "fp32"),
    ]


def sample_cases(smoke: bool) -> list[tuple[int, int, str, str]]:
    """(N, V, logits dtype, parameter mix) per sampling case."""
    if smoke:
        return [(1, 300, "fp32", "mixed"), (7, 300, "bf16", "mixed")]
    cases = [(n, VOCAB, "fp32", mix) for n in SAMPLE_ROWS for mix in ("mixed", "temperature", "typical")]
    extra = [(64, VOCAB, "fp32", "top_p"), (64, VOCAB, "fp32", "all"), (64, VOCAB, "bf16", "mixed")]
    greedy = [(n, VOCAB, dtype, "greedy") for dtype in ("fp32", "bf16") for n in (1, 64)]  # served logits are bf16
    return [*cases, *extra, *greedy]


def floor_us(num_bytes: int) -> float:
    """µs to read num_bytes once at the measured HBM bandwidth."""
    return num_bytes / HBM_BYTES_PER_S * 1e6


def time_us(fn: Callable[[int], object], copies: int, device: str) -> tuple[float, str]:
    """Median µs of fn(i) over rotating input copies i: a CUDA graph of CALLS calls, eager events if capture fails,
    and wall time on the CPU."""
    if device != "cuda":
        times = []
        for i in range(3):
            start = time.perf_counter()
            fn(i % copies)
            times.append((time.perf_counter() - start) * 1e6)
        return statistics.median(times), "cpu wall"
    for i in range(3):
        fn(i % copies)
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(CALLS):
                fn(i % copies)
        run, calls, how = graph.replay, CALLS, f"graph of {CALLS}"
    except Exception:  # capture refused: time eager calls
        torch.cuda.synchronize()
        run, calls, how = (lambda: [fn(i % copies) for i in range(CALLS)]), CALLS, f"eager x{CALLS}"
    for _ in range(3):
        run()
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(times), how


def cold_copies(x: torch.Tensor) -> list[torch.Tensor]:
    """x and enough fresh copies that cycling through them streams from HBM rather than L2."""
    count = max(1, min(CALLS, -(-COLD_BYTES // (x.numel() * x.element_size()))))
    return [x] + [x.clone() for _ in range(count - 1)]


def router_row_invariant(logits: torch.Tensor, k: int) -> bool:
    """The first rows bit-identical alone and inside batches of INVARIANCE_BATCHES and N."""
    n = logits.shape[0]
    rows = min(n, max(INVARIANCE_BATCHES))
    alone = [router_topk(logits[i : i + 1], k) for i in range(rows)]
    for batch in sorted({b for b in (*INVARIANCE_BATCHES, n) if b <= n}):
        weights, ids = router_topk(logits[:batch], k)
        for i in range(min(batch, rows)):
            if not (torch.equal(weights[i], alone[i][0][0]) and torch.equal(ids[i], alone[i][1][0])):
                return False
    return True


def run_router(n: int, experts: int, k: int, dtype: str, device: str, gen: torch.Generator) -> dict[str, object]:
    """One router case; an error is reported in the row, never raised."""
    row: dict[str, object] = {"kernel": "router", "n": n, "e": experts, "k": k, "dtype": dtype}
    try:
        logits = (torch.randn(n, experts, device=device, generator=gen) * 1.5).to(DTYPES[dtype])
        weights, ids = router_topk(logits, k)
        ref_w, ref_ids = router_topk_reference(logits, k)
        diff = (weights.double() - ref_w.double()).abs()
        row.update(
            ids_mismatch=int((ids != ref_ids).any(dim=-1).sum()),
            rel_err=((weights.double() - ref_w.double()).norm() / ref_w.double().norm()).item(),
            max_abs_err=diff.max().item(),
            nan=bool(weights.isnan().any()),
            row_invariant=router_row_invariant(logits, k),
        )
        copies = cold_copies(logits)
        t, how = time_us(lambda i: router_topk(copies[i], k), len(copies), device)
        floor = floor_us(logits.numel() * logits.element_size())
        row.update(time_us=t, timing=how, floor_us=floor, ratio=t / floor)
    except Exception as exc:  # a failing case is reported, the run goes on
        row["error"] = f"{exc!r}\n{traceback.format_exc()}"
    return row


def make_params(n: int, mix: str, device: str, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """(temperature, top_k, top_p, min_p, seed, position) for n rows cycling through a mix, with random keys."""
    t, k, p, m = zip(*(MIXES[mix][i % len(MIXES[mix])] for i in range(n)), strict=True)
    f64 = torch.float64
    seed = torch.randint(-(2**63), 2**63 - 1, (n,), device=device, generator=gen)
    position = torch.randint(0, 1 << 20, (n,), device=device, generator=gen)
    return (
        torch.tensor(t, dtype=f64, device=device),
        torch.tensor(k, device=device),
        torch.tensor(p, dtype=f64, device=device),
        torch.tensor(m, dtype=f64, device=device),
        seed,
        position,
    )


def server_tokens(logits: torch.Tensor, params: tuple[torch.Tensor, ...]) -> list[int]:
    """`sample_token` on each row alone (on the rows' device), -1 where it raises."""
    out = []
    for i, row in enumerate(logits):
        t, k, p, m, s, pos = (a[i].item() for a in params)
        try:
            out.append(sample_token(row, t, k, p, m, s, pos))
        except ValueError:
            out.append(-1)
    return out


def probs_bits_equal(logits: torch.Tensor, temperature: torch.Tensor) -> bool:
    """The batch's probabilities bit-identical to sample_token's softmax of each sampled row alone."""
    probs = scaled_softmax(logits.float(), temperature)
    for i, t in enumerate(temperature.tolist()):
        if t > 0 and not torch.equal(probs[i], torch.softmax(logits[i].float() / t, dim=-1)):
            return False
    return True


def sorted_probs(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """The torch stage of sample_rows alone (scaled softmax and stable sort), to split its time from the kernel's."""
    return torch.sort(scaled_softmax(logits.float(), temperature), dim=-1, descending=True, stable=True).values


def run_sample(n: int, vocab: int, dtype: str, mix: str, device: str, gen: torch.Generator) -> dict[str, object]:
    """One sampling case; an error is reported in the row, never raised."""
    row: dict[str, object] = {"kernel": "sample", "n": n, "v": vocab, "dtype": dtype, "mix": mix}
    try:
        logits = (torch.randn(n, vocab, device=device, generator=gen) * 3).to(DTYPES[dtype])
        params = make_params(n, mix, device, gen)
        tokens = sample_rows(logits, *params).tolist()
        expected = server_tokens(logits, params)
        alone = [sample_rows(logits[i : i + 1], *(a[i : i + 1] for a in params)).item() for i in range(n)]
        batched = [sample_rows(logits[:b], *(a[:b] for a in params)).tolist() for b in INVARIANCE_BATCHES if b <= n]
        row.update(
            mismatches=sum(a != b for a, b in zip(tokens, expected, strict=True)),
            rel_err=sum(a != b for a, b in zip(tokens, expected, strict=True)) / n,
            refused=tokens.count(-1),
            distinct_tokens=len(set(tokens)),
            probs_bits_equal=probs_bits_equal(logits, params[0]),
            row_invariant=alone == tokens and all(b == tokens[: len(b)] for b in batched),
        )
        copies = cold_copies(logits)
        t, how = time_us(lambda i: sample_rows(copies[i], *params), len(copies), device)
        sort_t, _ = time_us(lambda i: sorted_probs(copies[i], params[0]), len(copies), device)
        # as the runner passes them: temperatures on the host (greedy rows skip the sort), and in a greedy round the
        # other parameters too (one launch)
        host = (*(a.cpu() for a in params[:4]), *params[4:]) if not params[0].any() else (params[0].cpu(), *params[1:])
        host_tokens = sample_rows(logits, *host).tolist()
        host_t, host_how = time_us(lambda i: sample_rows(copies[i], *host), len(copies), device)
        floor = floor_us(logits.numel() * logits.element_size())
        row.update(time_us=t, timing=how, softmax_sort_us=sort_t, floor_us=floor, ratio=t / floor)
        row.update(host_temperature_us=host_t, host_timing=host_how, host_mismatches=_differ(host_tokens, tokens))
    except Exception as exc:  # a failing case is reported, the run goes on
        row["error"] = f"{exc!r}\n{traceback.format_exc()}"
    return row


def _differ(a: list[int], b: list[int]) -> int:
    """How many positions of two token lists differ."""
    return sum(x != y for x, y in zip(a, b, strict=True))


def passed(row: dict[str, object]) -> bool:
    """A case passes when it ran, matched its reference exactly (weights within 1e-6) and kept rows invariant."""
    if "error" in row or not row["row_invariant"]:
        return False
    if row["kernel"] == "router":
        return row["ids_mismatch"] == 0 and not row["nan"] and float(row["max_abs_err"]) <= WEIGHT_TOL
    return row["mismatches"] == 0 and row.get("host_mismatches", 0) == 0 and bool(row["probs_bits_equal"])


def line(row: dict[str, object]) -> str:
    """One printed line per case."""
    if row["kernel"] == "router":
        shape = f"router N={row['n']:<5} E={row['e']} k={row['k']} {row['dtype']}"
    else:
        shape = f"sample N={row['n']:<5} V={row['v']} {row['dtype']} {row['mix']}"
    if "error" in row:
        return f"{shape} ERROR {str(row['error']).splitlines()[0]}"
    return (
        f"{shape} time_us={row['time_us']:9.2f} floor_us={row['floor_us']:8.2f} ratio={row['ratio']:7.1f} "
        f"rel_err={row['rel_err']:.2e} row_invariant={row['row_invariant']} pass={passed(row)}"
        + (f" host_temperature_us={row['host_temperature_us']:.2f}" if "host_temperature_us" in row else "")
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command line: --out DIR; --smoke for tiny shapes; --only router|sample; --mix MIX (repeatable)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for router_sample.json")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (on the CPU under TRITON_INTERPRET=1)")
    parser.add_argument("--only", choices=("router", "sample"), help="run one kernel's cases")
    parser.add_argument("--mix", choices=tuple(MIXES), action="append", help="sampling cases of these mixes only")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run every case; 0 when all pass, 1 when one does not, 2 without a device to run on."""
    args = parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not (args.smoke and os.environ.get("TRITON_INTERPRET") == "1"):
        print(
            "gpu_check_router_sample: no CUDA device (use --smoke with TRITON_INTERPRET=1 on the CPU)", file=sys.stderr
        )
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    if args.only in (None, "router"):
        for case in router_cases(args.smoke):
            rows.append(run_router(*case, device, gen))
            print(line(rows[-1]), flush=True)
    if args.only in (None, "sample"):
        for case in sample_cases(args.smoke):
            if args.mix and case[3] not in args.mix:
                continue
            rows.append(run_sample(*case, device, gen))
            print(line(rows[-1]), flush=True)
    report = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter smoke run)",
        "timing": f"median of {REPLAYS} replays of a CUDA graph of {CALLS} calls over cold input copies, per call",
        "floor": "bytes of the logits read once / 4.27 TB/s",
        "cases": rows,
    }
    (args.out / "router_sample.json").write_text(json.dumps(report, indent=1))
    return 0 if all(passed(r) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
