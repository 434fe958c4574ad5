"""Time tp=2's combine on two GPUs at the real model's per-step sizes: the rank-ordered all_gather + sum, NCCL's fp32
all_reduce and PyTorch's symmetric-memory one-shot all-reduce, each eagerly and replayed in a CUDA graph, and check
that every method gives the same bits on both ranks.

timeout 300 torchrun --nproc-per-node 2 scripts/bench_collectives.py --json $OUT/collectives.json

NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 are set (unless already set) before
torch.distributed is imported: NVLink multicast stays off on the lent machines (docs/gpu.md). The timings are CUDA
event medians after a warm-up, the slower rank's; a graph holds `--graph-calls` back-to-back calls and its replay time
is divided by them. Exit status 1 when any method's bits differ from the ordered sum's or between the ranks.
"""

from __future__ import annotations

import os

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
for _name, _value in MULTICAST_OFF.items():
    os.environ.setdefault(_name, _value)

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from model.config import load_config  # noqa: E402
from model.parallel import TensorParallel  # noqa: E402

ROWS = (1, 4, 8, 64, 256)
METHODS = ("gather_sum", "all_reduce", "symm_mem_one_shot")
MODEL = ROOT / "configs" / "qwen3.8-flash-next"
Combine = Callable[[torch.Tensor], torch.Tensor]


def parse_rows(text: str) -> tuple[int, ...]:
    """Comma-separated positive row counts."""
    try:
        rows = tuple(int(part) for part in text.split(","))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--rows: {text!r} is not a comma-separated list of integers") from exc
    if not rows or min(rows) < 1:
        raise argparse.ArgumentTypeError(f"--rows: {text!r} needs positive row counts")
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write the results here (rank 0)")
    parser.add_argument("--rows", type=parse_rows, default=ROWS, help="rows per combine, comma-separated")
    parser.add_argument("--model", type=Path, default=MODEL, help="folder whose config.json gives the sizes")
    parser.add_argument("--iters", type=int, default=200, help="timed eager calls")
    parser.add_argument("--warmup", type=int, default=20, help="untimed calls (and replays) first")
    parser.add_argument("--graph-calls", type=int, default=32, help="back-to-back calls captured in one graph")
    parser.add_argument("--graph-replays", type=int, default=50, help="timed graph replays")
    return parser.parse_args(argv)


def sizes(hidden: int, rows: tuple[int, ...]) -> list[dict[str, int]]:
    """Each combine's rows and bytes: fp32 partial sums [rows, hidden]."""
    return [{"rows": r, "bytes": r * hidden * 4} for r in rows]


def combines_per_forward(model_dir: Path) -> tuple[int, int]:
    """The model's hidden size and its combines in one trunk forward (after every mixer and every MoE)."""
    cfg = load_config(model_dir)
    return cfg.hidden_size, 2 * cfg.num_hidden_layers


def partial_sums(rank: int, rows: int, hidden: int) -> torch.Tensor:
    """A rank's fp32 partial [rows, hidden] with magnitudes from 1e-8 to 1e8, so the sums round."""
    gen = torch.Generator().manual_seed(7919 * rank + rows)
    scale = 10.0 ** torch.randint(-8, 9, (rows, hidden), generator=gen)
    return torch.randn(rows, hidden, generator=gen) * scale


def symm_mem_one_shot(rows: int, hidden: int, device: torch.device) -> Combine:
    """PyTorch's one-shot all-reduce: the partial copied into a symmetric buffer, every peer's read over NVLink."""
    from torch.distributed import _symmetric_memory as symm_mem

    group = dist.group.WORLD.group_name
    buffer = symm_mem.empty(rows, hidden, dtype=torch.float32, device=device)
    symm_mem.rendezvous(buffer, group)
    return lambda partial: torch.ops.symm_mem.one_shot_all_reduce_copy(buffer, partial, "sum", group)


def time_eager(combine: Combine, partial: torch.Tensor, iters: int, warmup: int) -> float:
    """Median microseconds of one call, each timed by its own events."""
    for _ in range(warmup):
        combine(partial)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    torch.cuda.synchronize()
    for start, end in events:
        start.record()
        combine(partial)
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) * 1000 for start, end in events)


def time_graph(
    combine: Combine, partial: torch.Tensor, calls: int, replays: int, warmup: int
) -> tuple[float, torch.Tensor]:
    """Median microseconds of one call inside a graph of `calls` back-to-back calls, and the last call's output."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            combine(partial)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            out = combine(partial)
    for _ in range(warmup):
        graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    torch.cuda.synchronize()
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) * 1000 / calls for start, end in events), out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit."""
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def slowest(values: list[float]) -> list[float]:
    """The larger of each value over the ranks."""
    t = torch.tensor(values, dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def everywhere(flag: bool) -> bool:
    """True only when every rank says so."""
    t = torch.tensor([int(flag)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def combiner(method: str, tp: TensorParallel, rows: int, hidden: int, device: torch.device) -> Combine:
    """The combine `method` names."""
    if method == "gather_sum":
        return tp.combine_ordered
    if method == "all_reduce":
        return tp.combine
    return symm_mem_one_shot(rows, hidden, device)


def measure(method: str, tp: TensorParallel, size: dict[str, int], hidden: int, args: argparse.Namespace) -> dict:
    """One method at one size: eager and graph times and whether its bits match the ordered sum on both ranks."""
    rows, device = size["rows"], torch.device("cuda", torch.cuda.current_device())
    record: dict[str, object] = {"method": method, **size}
    partial = partial_sums(tp.rank, rows, hidden).to(device)
    reference = tp.combine_ordered(partial)
    peers = torch.empty(2, rows, hidden, dtype=torch.float32, device=device)
    dist.all_gather_into_tensor(peers, reference)
    try:
        combine = combiner(method, tp, rows, hidden, device)
        outputs = [combine(partial)]
    except Exception as exc:  # symmetric memory may be missing from this build or this machine
        record["unavailable"] = f"{type(exc).__name__}: {exc}"
        return record
    times = [time_eager(combine, partial, args.iters, args.warmup)]
    try:
        graph_us, graph_out = time_graph(combine, partial, args.graph_calls, args.graph_replays, args.warmup)
        times.append(graph_us)
        outputs.append(graph_out)
    except Exception as exc:  # a method that cannot be captured still reports its eager time
        record["graph_error"] = f"{type(exc).__name__}: {exc}"
    record["eager_us"], *graph = slowest(times)
    record["graph_us"] = graph[0] if graph else None
    same = all(same_bits(out, reference) for out in outputs) and same_bits(peers[0], peers[1])
    record["bits_equal"] = everywhere(same)
    return record


def format_table(records: list[dict], per_forward: int) -> str:
    """The results as a fixed-width table; the last column is the graph time of one forward's `per_forward` combines."""
    forward = f"x{per_forward} us"
    lines = [f"{'rows':>5} {'bytes':>9} {'method':<18} {'eager us':>9} {'graph us':>9} {'bits':>5} {forward:>8}"]
    for r in records:
        head = f"{r['rows']:>5} {r['bytes']:>9} {r['method']:<18}"
        if "unavailable" in r:
            lines.append(f"{head} unavailable: {r['unavailable']}")
            continue
        bits = "same" if r["bits_equal"] else "DIFF"
        if r["graph_us"] is None:
            lines.append(f"{head} {r['eager_us']:>9.1f} {'-':>9} {bits:>5} {'-':>8}  graph: {r['graph_error']}")
            continue
        row = f" {r['eager_us']:>9.1f} {r['graph_us']:>9.1f} {bits:>5} {r['graph_us'] * per_forward:>8.0f}"
        lines.append(head + row)
    return "\n".join(lines)


def report(records: list[dict], hidden: int, per_forward: int, device: str) -> dict:
    """The JSON document."""
    return {
        "torch": torch.__version__,
        "nccl": str(torch.cuda.nccl.version()) if torch.cuda.is_available() else None,
        "device": device,
        "env": {name: os.environ.get(name) for name in MULTICAST_OFF},
        "hidden_size": hidden,
        "combines_per_forward": per_forward,
        "results": records,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    try:
        if dist.get_world_size() != 2:
            raise SystemExit("run on two GPUs: torchrun --nproc-per-node 2")
        tp = TensorParallel(dist.get_rank(), 2)
        hidden, per_forward = combines_per_forward(args.model)
        records = [measure(m, tp, size, hidden, args) for m in METHODS for size in sizes(hidden, args.rows)]
        if tp.rank == 0:
            print(format_table(records, per_forward), flush=True)
            if args.json is not None:
                doc = report(records, hidden, per_forward, torch.cuda.get_device_name())
                args.json.write_text(json.dumps(doc, indent=2) + "\n")
        return 0 if all(r.get("bits_equal", True) for r in records) else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
