"""GPU check of the Gated DeltaNet recurrence, its chunked form over prompts, and the causal depthwise convs at the
per-rank shapes of tp=2: error against the torch references, row invariance (batches of 1, 2, 7, 64 lanes), and
CUDA-graph time against the floor.

python3 scripts/gpu_check_gdn.py --out DIR        # writes DIR/gdn.json and prints one line per case
python3 scripts/gpu_check_gdn.py --out DIR --smoke  # tiny shapes on the CPU under the Triton interpreter, untimed
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from gpu_timing import graph_median_us

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

BANDWIDTH = 4.27e12  # bytes/s, measured device-to-device copy on the project's H200s
BF16_RATE = 790e12  # dense bf16 FLOP/s of one H200
GRAPH_CALLS = 10  # kernel calls captured in one timed graph


@dataclass(frozen=True)
class Config:
    """Widths and batch layouts of one run."""

    heads: int
    key_heads: int
    dk: int
    dv: int
    convs: tuple[tuple[int, int], ...]  # (channels, dilation)
    kernel: int
    lane_counts: tuple[int, ...]
    windows: tuple[int, ...]  # rows per lane: 1 decode, 4 verify
    prefill: int
    batches: tuple[int, ...]
    prompts: tuple[int, ...]  # one lane's prompt pass, from position 0: the recurrence against the chunked form


REAL = Config(24, 8, 128, 128, ((5120, 1), (10240, 3)), 4, (1, 8, 64), (1, 4), 8192, (1, 2, 7, 64), (1024, 8192))
SMOKE = Config(3, 1, 16, 16, ((40, 1), (40, 3)), 4, (2,), (1, 3), 20, (1, 2, 5), (70,))


@dataclass(frozen=True)
class Case:
    """One batch: the kernel, a name, rows per lane (lane i owns slot i), whether per-row states are kept."""

    kernel: str
    name: str
    lens: tuple[int, ...]
    keep: bool
    channels: int = 0
    dilation: int = 1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for gdn.json")
    ap.add_argument("--reps", type=int, default=25, help="timed graph replays (median reported)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under the Triton interpreter")
    ap.add_argument("--names", nargs="*", help="only these cases (decode, verify4, prefill, prompt; default all)")
    return ap.parse_args(argv)


def cases(cfg: Config) -> list[Case]:
    """Decode (1 row a lane), verify windows (keeping per-row states) and one prefill lane, for each kernel."""
    layouts = [
        ("decode" if rows == 1 else f"verify{rows}", (rows,) * lanes, rows > 1)
        for rows in cfg.windows
        for lanes in cfg.lane_counts
    ]
    layouts.append(("prefill", (cfg.prefill,), False))
    out = [Case("gdn", name, lens, keep) for name, lens, keep in layouts]
    out += [Case("gdn", "prompt", (rows,), False) for rows in cfg.prompts if rows != cfg.prefill]
    out += [Case("gdn_chunked", "prompt", (rows,), False) for rows in cfg.prompts]
    for channels, dilation in cfg.convs:
        out += [Case("conv", name, lens, keep, channels, dilation) for name, lens, keep in layouts]
    return out


def lane_of_row(lens: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Slot of each row: lane i's rows are consecutive and use slot i."""
    return torch.repeat_interleave(torch.arange(len(lens), device=device), torch.tensor(lens, device=device)).int()


def runs_of(lanes: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """Each lane's consecutive rows as (first row, rows, first position 0, slot), as `plan_chunks` takes them."""
    ids, runs, start = lanes.tolist(), [], 0
    for row in range(1, len(ids) + 1):
        if row == len(ids) or ids[row] != ids[start]:
            runs.append((start, row - start, 0, ids[start]))
            start = row
    return runs


def chunk_layout(lanes: torch.Tensor) -> tuple:
    """What the model lays out on the host for a round with whole chunks: the plan, the recurrence's lane ids and
    the rows that start its runs (a graph's capture cannot read lanes back to the host)."""
    from kernels.gdn import run_firsts
    from kernels.gdn_chunk import plan_chunks, recurrent_lanes

    runs = runs_of(lanes)
    rest = recurrent_lanes(lanes.cpu(), runs)
    return (
        plan_chunks(runs, lanes.shape[0], lanes.device),
        rest.to(lanes.device),
        run_firsts(rest, len(runs)).to(lanes.device),
    )


def gdn_inputs(cfg: Config, lens: tuple[int, ...], gen: torch.Generator, device: torch.device) -> dict:
    """q, k, v as views of one post-conv qkv buffer, g and beta as the model makes them, a random fp32 state."""
    seq, qk = sum(lens), cfg.key_heads * cfg.dk
    qkv = F.silu(torch.randn(seq, 2 * qk + cfg.heads * cfg.dv, generator=gen, device=device)).bfloat16()
    a = torch.randn(seq, cfg.heads, generator=gen, device=device)
    return {
        "q": qkv[:, :qk].view(seq, cfg.key_heads, cfg.dk),
        "k": qkv[:, qk : 2 * qk].view(seq, cfg.key_heads, cfg.dk),
        "v": qkv[:, 2 * qk :].view(seq, cfg.heads, cfg.dv),
        "g": -F.softplus(a + 1.0) * 0.5,
        "beta": torch.sigmoid(torch.randn(seq, cfg.heads, generator=gen, device=device)),
        "state": 0.1 * torch.randn(len(lens), cfg.heads, cfg.dk, cfg.dv, generator=gen, device=device),
    }


def conv_inputs(cfg: Config, case: Case, gen: torch.Generator, device: torch.device) -> dict:
    """x, the lanes' tails and the taps in bf16."""
    seq, kept = sum(case.lens), (cfg.kernel - 1) * case.dilation

    def randn(*size: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*size, generator=gen, device=device)).bfloat16()

    return {
        "x": randn(seq, case.channels),
        "tail": randn(len(case.lens), kept, case.channels),
        "weight": randn(case.channels, cfg.kernel, scale=0.5),
    }


def run(
    case: Case, inputs: dict, lanes: torch.Tensor, reference: bool = False, in_place: bool = False
) -> dict[str, torch.Tensor]:
    """Run the kernel (or its reference) on copies of the state or tails (or on them, in_place); outputs, state."""
    from kernels.conv import causal_conv_update, causal_conv_update_reference
    from kernels.gdn import LONG_RUN, gdn_recurrent, gdn_recurrent_reference
    from kernels.gdn_chunk import gdn_prompt

    if case.kernel in ("gdn", "gdn_chunked"):
        state = inputs["state"] if in_place else inputs["state"].clone()
        args = (inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], state)
        if reference:
            out, states = gdn_recurrent_reference(*args, lanes, keep_states=case.keep)
        elif case.kernel == "gdn_chunked":  # as the model calls it: whole chunks, then the other rows
            layout = inputs["layout"] if "layout" in inputs else chunk_layout(lanes)  # made before a capture
            out, states = gdn_prompt(*args, *layout[:2], firsts=layout[2])
        else:  # as the model calls it: a prompt pass normalizes q and k in a kernel of their own
            out, states = gdn_recurrent(*args, lanes, keep_states=case.keep, long_runs=max(case.lens) >= LONG_RUN)
        return {"out": out, "state": state} | ({"states": states} if states is not None else {})
    tail = inputs["tail"] if in_place else inputs["tail"].clone()
    x = inputs["x"]
    row_tails = x.new_empty((x.shape[0], *tail.shape[1:])) if case.keep else None
    fn = causal_conv_update_reference if reference else causal_conv_update
    out = fn(x, tail, inputs["weight"], lanes, case.dilation, "silu", row_tails)
    return {"out": out, "tail": tail} | ({"row_tails": row_tails} if row_tails is not None else {})


def inputs_for(cfg: Config, case: Case, gen: torch.Generator, device: torch.device) -> dict:
    """Fresh random inputs for a case."""
    return conv_inputs(cfg, case, gen, device) if case.kernel == "conv" else gdn_inputs(cfg, case.lens, gen, device)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64."""
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def select_lanes(case: Case, inputs: dict, chosen: list[int]) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """The rows of the chosen lanes, in that order, keeping their slots: (inputs, lane_of_row, row indices)."""
    starts = [sum(case.lens[:i]) for i in range(len(case.lens))]
    device = next(iter(inputs.values())).device
    rows = torch.cat([torch.arange(starts[i], starts[i] + case.lens[i], device=device) for i in chosen])
    lanes = torch.cat([torch.full((case.lens[i],), i, device=device, dtype=torch.int32) for i in chosen])
    stateful = ("state", "tail", "weight")
    picked = {name: t if name in stateful else t.index_select(0, rows) for name, t in inputs.items()}
    return picked, lanes, rows


def check_invariance(cfg: Config, case: Case, gen: torch.Generator, device: torch.device) -> bool:
    """Each lane's rows and state are bit-identical among all lanes and in smaller, reordered batches."""
    pool = max(cfg.batches)
    lens = (case.lens[0],) + (case.lens[-1] if len(case.lens) > 1 else 1,) * (pool - 1)
    pool_case = Case(case.kernel, case.name, lens, case.keep, case.channels, case.dilation)
    inputs = inputs_for(cfg, pool_case, gen, device)
    full = run(pool_case, inputs, lane_of_row(lens, device))
    for batch in cfg.batches:
        chosen = [*range(pool - 1, pool - batch, -1), 0]
        picked, lanes, rows = select_lanes(pool_case, inputs, chosen)
        part = run(pool_case, picked, lanes)
        slots = torch.tensor(chosen, device=device)
        for name, value in part.items():
            index = rows if name in ("out", "states", "row_tails") else slots
            mine = value if index is rows else value.index_select(0, slots)
            if not torch.equal(mine, full[name].index_select(0, index)):
                return False
    return True


def floors(cfg: Config, case: Case) -> tuple[float, float]:
    """(bytes, FLOPs) a step cannot do without: state or tails read and written, inputs read, kept states written."""
    seq, lanes = sum(case.lens), len(case.lens)
    if case.kernel != "conv":
        state = cfg.heads * cfg.dk * cfg.dv * 4
        qkv = seq * (2 * cfg.key_heads * cfg.dk + cfg.heads * cfg.dv) * 2
        kept = seq * state if case.keep else 0
        return lanes * state * 2 + qkv + kept, 7.0 * seq * cfg.heads * cfg.dk * cfg.dv
    rows, tail = seq * case.channels * 2, (cfg.kernel - 1) * case.dilation * case.channels * 2
    kept = seq * tail if case.keep else 0
    return 2 * rows + 2 * lanes * tail + case.channels * cfg.kernel * 2 + kept, 0.0


def time_graph(fn: Callable[[], object], reps: int) -> float:
    """Median µs of one call, from CUDA-graph replays of GRAPH_CALLS calls timed with events."""
    return graph_median_us([fn], GRAPH_CALLS, reps)


def run_case(cfg: Config, case: Case, args: argparse.Namespace, device: torch.device) -> dict[str, object]:
    """Accuracy, NaN, row invariance and time of one case; an exception is reported, not raised."""
    res: dict[str, object] = {
        "kernel": case.kernel,
        "name": case.name,
        "lanes": len(case.lens),
        "rows_per_lane": case.lens[0],
        "keep": case.keep,
        "shape": describe_shape(cfg, case),
    }
    gen = torch.Generator(device=device).manual_seed(args.seed)
    try:
        inputs = inputs_for(cfg, case, gen, device)
        lanes = lane_of_row(case.lens, device)
        got, ref = run(case, inputs, lanes), run(case, inputs, lanes, reference=True)
        errs = {name: rel_err(got[name], ref[name]) for name in ref}
        res["rel_err"] = max(errs.values())
        res["rel_errs"] = errs
        res["nan"] = any(bool(t.float().isnan().any()) for t in got.values())
        res["row_invariant"] = check_invariance(cfg, case, gen, device)
        nbytes, flops = floors(cfg, case)
        res["floor_us"] = nbytes / BANDWIDTH * 1e6
        if flops:
            res["flop_floor_us"] = flops / BF16_RATE * 1e6
        if device.type == "cuda":
            timed = {name: t.clone() if name in ("state", "tail") else t for name, t in inputs.items()}
            if case.kernel == "gdn_chunked":
                timed["layout"] = chunk_layout(lanes)
            res["time_us"] = time_graph(lambda: run(case, timed, lanes, in_place=True), args.reps)
            res["ratio"] = res["time_us"] / res["floor_us"]
            if flops:
                res["flop_ratio"] = res["time_us"] / res["flop_floor_us"]
    except Exception as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"
        res["traceback"] = traceback.format_exc()
    return res


def describe_shape(cfg: Config, case: Case) -> str:
    """Short text of a case's shape."""
    rows = f"L={len(case.lens)}x{case.lens[0]}"
    if case.kernel != "conv":
        heads = f"H={cfg.heads} Hk={cfg.key_heads} Dk={cfg.dk} Dv={cfg.dv}"
        return f"{case.kernel} {case.name} {rows} {heads} keep={case.keep}"
    return f"conv {case.name} {rows} C={case.channels} K={cfg.kernel} d={case.dilation} keep={case.keep}"


def describe(res: dict[str, object]) -> str:
    """One printed line per case."""
    if "error" in res:
        return f"{res['shape']}: ERROR {res['error']}"

    def num(key: str, fmt: str) -> str:
        return format(res[key], fmt) if key in res else "-"

    line = (
        f"{res['shape']}: time_us={num('time_us', '.2f')} floor_us={num('floor_us', '.2f')} "
        f"ratio={num('ratio', '.2f')} rel_err={num('rel_err', '.2e')} row_invariant={res['row_invariant']}"
    )
    if "flop_floor_us" in res:
        line += f" flop_floor_us={num('flop_floor_us', '.2f')} flop_ratio={num('flop_ratio', '.2f')}"
    return line + (" NAN" if res["nan"] else "")


def main(argv: list[str] | None = None) -> int:
    """Run every case, print one line each, write DIR/gdn.json; 0 when all are accurate and row-invariant."""
    args = parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        cfg, device = SMOKE, torch.device("cpu")
    elif torch.cuda.is_available():
        cfg, device = REAL, torch.device("cuda")
    else:
        print("gpu_check_gdn: no CUDA device (use --smoke for the CPU path)", file=sys.stderr)
        return 2
    results = []
    for case in cases(cfg):
        if args.names and case.name not in args.names:
            continue
        res = run_case(cfg, case, args, device)
        print(describe(res), flush=True)
        results.append(res)
    target = next((r for r in results if r["kernel"] == "gdn" and r["name"] == "decode" and r["lanes"] == 64), None)
    report = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)",
        "bandwidth": BANDWIDTH,
        "cases": results,
        "target_gdn_decode64_within_1.6x": None if target is None or "ratio" not in target else target["ratio"] <= 1.6,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gdn.json").write_text(json.dumps(report, indent=2))
    ok = all("error" not in r and r["row_invariant"] and not r["nan"] for r in results)
    ok = ok and all(r["rel_err"] <= (1e-2 if r["kernel"] == "conv" else 1e-5) for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
