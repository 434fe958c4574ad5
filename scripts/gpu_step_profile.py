"""Where a step's time goes at the real shapes, tp=2, dummy weights: decode rounds of 1, 4, 8 and 64 lanes through
the model with CUDA graphs, timed on the host (wall time of a forward, synchronised) and on the GPU (CUDA events
over the graph's replay alone); one lane's verify round with 0..3 drafts (every row's state kept); then
torch.profiler's kernel and host tables for five rounds of one lane, of the most lanes and of a 3-draft verify
round on rank 0, and each kernel's share of the GPU's busy time (`busy_shares`: what the kernels add up to when
PDL overlaps each with the one before); with --prompt ROWS also one lane's eager prompt pass of ROWS rows, timed
and profiled (three passes).

timeout 400 torchrun --nproc-per-node 2 scripts/gpu_step_profile.py --out DIR [--lanes N ...] [--context POSITIONS]
(--nproc-per-node 1 runs the model whole, tp=1, on one GPU; --peer-sums at two: the combines inside the hyper writes)
python3 scripts/gpu_step_profile.py --out DIR --alone-as 2 ...   # rank 0's half on one GPU, no links (timing only)
    [--random-tokens VOCAB]   # prompts and rows of random tokens below VOCAB, so lanes route as served ones do
    [--prompt ROWS]           # a prompt pass as a served prompt round makes it (ROWS <= POSITIONS), and the MTP
                              # layer's pass over its rows
    [--chrome-trace]          # the kernels, with their streams, of one lane's profiled rounds (DIR/step_trace.json.gz),
                              # the most lanes' (DIR/step_trace_N.json.gz) and the verify rounds'
                              # (DIR/step_trace_verify.json.gz); not of the prompt ones
# DIR/step_profile.txt (one lane), step_profile_N.txt (the most lanes), step_profile_verify.txt,
# step_profile_prompt.txt, step_profile_prompt_mtp.txt, step_profile.json
"""

from __future__ import annotations

import argparse
import functools
import heapq
import itertools
import json
import os
import random
import statistics
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

for name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ.setdefault(name, "0" if name == "NCCL_NVLS_ENABLE" else "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]

from gpu_profile_round import decode_batch  # noqa: E402

from model import kernel_path  # noqa: E402
from model.config import load_config  # noqa: E402
from model.flashnext import FlashNextModel  # noqa: E402
from model.parallel import TensorParallel  # noqa: E402
from model.peer_sums import PeerSums  # noqa: E402
from model.state import LaneState  # noqa: E402
from model.weights import load_model  # noqa: E402

LANES = (1, 4, 8, 64)
WINDOW = 4  # a verify window's rows: the pending token and up to three drafts
HOST_LINES = 12  # host operations listed per profiled step
SHARES = 24  # kernels' busy shares listed (and kept in step_profile.json) per profiled step


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for step_profile.json and step_profile.txt")
    ap.add_argument("--model", type=Path, default=ROOT / "configs/qwen3.8-flash-next", help="config folder")
    ap.add_argument("--rounds", type=int, default=20, help="timed decode rounds per lane count")
    ap.add_argument("--lanes", type=int, nargs="+", default=list(LANES), help=f"lane counts (default {list(LANES)})")
    ap.add_argument("--context", type=int, default=1024, help="positions a pool slot holds (default 1024)")
    ap.add_argument("--random-tokens", type=int, default=0, metavar="VOCAB",
                    help="feed random tokens below VOCAB (same seed on both ranks) instead of fixed ones")  # fmt: skip
    ap.add_argument("--prompt", type=int, default=0, metavar="ROWS", help="also time and profile a prompt pass")
    ap.add_argument("--ngram-table", choices=("device", "host"), default="device", help="where the n-gram table lives")
    ap.add_argument("--chrome-trace", action="store_true",
                    help="also write the profiled decode and verify rounds as Chrome traces")  # fmt: skip
    ap.add_argument("--alone-as", type=int, default=0, metavar="WORLD",
                    help="no torchrun: rank 0's share of a WORLD-rank model, collectives skipped")  # fmt: skip
    ap.add_argument("--peer-sums", action="store_true",
                    help="two ranks: combines summed in the hyper writes (model/peer_sums.py)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.alone_as < 0 or args.alone_as == 1:
        ap.error(f"--alone-as: {args.alone_as} is not a world of two or more ranks")
    if args.peer_sums and args.alone_as:
        ap.error("--peer-sums: needs the two ranks of torchrun, not --alone-as")
    return args


@contextmanager
def collectives_skipped() -> Iterator[None]:
    """One rank without its peers: an all-reduce leaves its input as it is and an all-gather copies the local part
    into every slot, so kernel times are a rank's without the links (the values are not the model's)."""
    saved = dist.all_reduce, dist.all_gather

    def gather(parts: list[torch.Tensor], local: torch.Tensor, *_args: object, **_kwargs: object) -> None:
        for part in parts:
            part.copy_(local)

    dist.all_reduce, dist.all_gather = (lambda *_args, **_kwargs: None), gather
    try:
        yield
    finally:
        dist.all_reduce, dist.all_gather = saved


def restore_length(lane: LaneState, length: int) -> None:
    """Cut a lane's caches back to `length` tokens (its recurrent states keep the rows: timing only)."""
    lane.length = length
    for cache in lane.attention.values():
        cache.length = min(cache.length, length)


def mtp_prompt_pass(
    model: FlashNextModel, lane: LaneState, rows: int, vocab: int, rng: random.Random | None
) -> Callable[[], torch.Tensor]:
    """A pass of the MTP layer over a `rows`-row prompt's wide states from position 0, asking for the last row's
    logits only (a served prompt round's drafting lane); each pass writes the same positions, so it repeats."""
    restore_length(lane, 0)
    batch = decode_batch([lane], rows, vocab, rng)
    hidden = model(batch).hidden
    last = torch.tensor([rows - 1], device=hidden.device)

    def run() -> torch.Tensor:
        return model.mtp_forward(batch, hidden, logit_rows=last)[0]

    return run


def per_round(events, rounds: int) -> list[dict]:
    """Kernels (device events only, so no host op counts its kernels again) by self GPU time, fastest last: ms and
    calls per round."""
    device = torch.autograd.DeviceType.CUDA
    timed = [e for e in events if e.device_type == device and getattr(e, "self_device_time_total", 0) > 0]
    timed.sort(key=lambda e: e.self_device_time_total, reverse=True)
    return [{"name": e.key, "ms": e.self_device_time_total / 1e3 / rounds, "calls": e.count / rounds} for e in timed]


def busy_shares(spans: list[tuple[str, float, float]]) -> tuple[Counter[str], float]:
    """Each kernel name's share of the GPU's busy time from (name, start, end) spans, and the idle time between the
    first start and the last end. Each stretch where kernels run goes to the earliest started among them: under PDL a
    kernel starts while the one before it runs and waits for it, so the stretch is the earlier one's work. Streams
    are not told apart: a side-stream kernel running beside an earlier started one gets no share of that stretch."""
    shares: Counter[str] = Counter()
    idle = 0.0
    by_start = sorted(spans, key=lambda span: span[1])
    points = sorted({t for _name, start, end in spans for t in (start, end)})
    running: list[tuple[float, float, str]] = []  # (start, end, name), earliest start first
    nxt = 0
    for begin, finish in itertools.pairwise(points):
        while nxt < len(by_start) and by_start[nxt][1] <= begin:
            name, start, end = by_start[nxt]
            heapq.heappush(running, (start, end, name))
            nxt += 1
        while running and running[0][1] <= begin:
            heapq.heappop(running)
        if running:
            shares[running[0][2]] += finish - begin
        else:
            idle += finish - begin
    return shares, idle


def profile(
    step: Callable[[], object], label: str, rank: int, rounds: int = 5, trace: Path | None = None
) -> tuple[str, dict[str, object]]:
    """(torch.profiler's kernel table, the busy time) of `rounds` calls of `step` (every rank profiles, so both pay
    its cost alike); rank 0 prints each kernel's ms and calls a round, then the host operations that took the most
    host time, writes the rounds to `trace` (gzipped Chrome trace: every kernel with its stream) when given, and
    returns the GPU's busy and idle ms a round with the SHARES largest kernel shares (empty on other ranks)."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(rounds):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    busy_report: dict[str, object] = {}
    if rank == 0:
        if trace is not None:  # torch gzips a path that ends in .gz
            trace.parent.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(trace))
        kernels = per_round(events, rounds)
        total_ms, launches = sum(k["ms"] for k in kernels), sum(k["calls"] for k in kernels)
        print(f"kernels, {label}, per round: {total_ms:.3f} ms in {launches:.0f} launches", flush=True)
        for line in kernels[:24]:
            print(f"  {line['ms']:7.3f} ms {line['calls']:6.1f} calls  {line['name'][:90]}", flush=True)
        device = torch.autograd.DeviceType.CUDA
        spans = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == device]
        shares, idle = busy_shares(spans)
        busy = sum(shares.values())
        shares_ms = f"{busy / 1e3 / rounds:.3f} ms (idle between: {idle / 1e3 / rounds:.3f})"
        print(f"busy time, {label}, per round: {shares_ms}", flush=True)
        largest = {name: us / 1e3 / rounds for name, us in shares.most_common(SHARES)}
        for name, ms in largest.items():
            print(f"  {ms:7.3f} ms  {name[:90]}", flush=True)
        print(f"host, {label}, per round:", flush=True)
        for e in sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:HOST_LINES]:
            print(f"  {e.self_cpu_time_total / 1e3 / rounds:7.3f} ms {e.count / rounds:6.1f} calls  {e.key[:90]}")
        busy_report = {"ms": busy / 1e3 / rounds, "idle_ms": idle / 1e3 / rounds, "shares_ms": largest}
    return events.table(sort_by="self_cuda_time_total", row_limit=40), busy_report


def sync_sites(step: Callable[[], object]) -> list[tuple[str, int]]:
    """Where one call of `step` makes the host wait for the GPU (file:line, times), from torch's sync warnings."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught).most_common()


def decode_round(model: FlashNextModel, lanes: list[LaneState], vocab: int, rng: random.Random | None) -> None:
    """One decode row for each lane."""
    model(decode_batch(lanes, 1, vocab, rng))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.alone_as:
        with collectives_skipped():
            return run(args, TensorParallel(0, args.alone_as))
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    peer = None
    if args.peer_sums:  # opened on this rank's device, before the model loads (run sets it again)
        torch.cuda.set_device(rank)
        peer = PeerSums.open(torch.device("cuda", rank), load_config(args.model).hidden_size)
    code = run(args, TensorParallel(rank, world, peer=peer))
    dist.barrier()
    dist.destroy_process_group()
    return code


def run(args: argparse.Namespace, tp: TensorParallel) -> int:
    """Load, time and profile as rank `tp.rank` of `tp.world`."""
    rank = tp.rank
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    model = load_model(
        args.model,
        device=device,
        dtype="bfloat16",
        tp=tp,
        load_format="dummy",
        kernels="on",
        ngram_table=args.ngram_table,
    )
    most = max(args.lanes)
    # a slot more than the most lanes: the verify rounds' lane then never grows the pool (which makes the graphs stale)
    kernel_path.lane_pool(model, slots=most + 1, context=args.context)
    graphs = kernel_path.enable_graphs(model, {"trunk": most, "verify": WINDOW})
    rows, rows_report, vocab, tables, busy, prompt_report = [], [], model.cfg.vocab_size, {}, {}, None
    if not 0 <= args.prompt <= args.context:
        raise SystemExit(f"--prompt: {args.prompt} rows do not fit a slot of --context {args.context} positions")
    if not 0 <= args.random_tokens <= vocab:
        raise SystemExit(f"--random-tokens: {args.random_tokens} is outside the model's vocabulary of {vocab}")
    rng = random.Random(0) if args.random_tokens else None  # ranks draw the same sequence
    vocab = args.random_tokens or vocab
    for count in args.lanes:
        lanes = [model.new_lane() for _ in range(count)]  # the last count's lanes free their slots when dropped
        for lane in lanes:  # a short prompt each, within the graphs' buckets (random ones route like served prompts)
            model(decode_batch([lane], 16, vocab, rng))
        host, gpu = [], []
        for i in range(args.rounds + 3):
            torch.cuda.synchronize()
            start = time.perf_counter()
            model(decode_batch(lanes, 1, vocab, rng))
            torch.cuda.synchronize()
            if i >= 3:
                host.append((time.perf_counter() - start) * 1e3)
        graph = graphs.graphs["trunk", graphs.bucket_of("trunk", count)]
        for _ in range(args.rounds):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            gpu.append(begin.elapsed_time(end))
        rows.append({"lanes": count, "forward_wall_ms": statistics.median(host), "replay_ms": statistics.median(gpu)})
        if rank == 0:
            print(json.dumps(rows[-1]), flush=True)
        if count == most:  # profiled while these lanes hold the pool (nothing keeps them after: a lane more would
            # grow the pool, and every later round would run eagerly, the graphs stale)
            trace = args.out / f"step_trace_{most}.json.gz" if args.chrome_trace and most > 1 else None
            tables[f"_{most}"], most_busy = profile(
                functools.partial(decode_round, model, lanes, vocab, rng), f"{most} lanes", rank, trace=trace
            )
            if most > 1:  # one lane's is the "1 lane" profile below
                busy[f"{most} lanes"] = most_busy
    del lanes
    lanes = [model.new_lane()]
    model(decode_batch(lanes, 16, vocab))
    for window in range(1, WINDOW + 1):  # one lane's verify round with 0..3 drafts: every row's state kept
        times = []
        for i in range(args.rounds + 3):
            batch = decode_batch(lanes, window, vocab, rng)
            torch.cuda.synchronize()
            start = time.perf_counter()
            model(batch, snapshot_rows={0: range(window)})
            torch.cuda.synchronize()
            restore_length(lanes[0], lanes[0].length - window)
            if i >= 3:
                times.append((time.perf_counter() - start) * 1e3)
        rows_report.append({"drafts": window - 1, "verify_wall_ms": statistics.median(times)})
        if rank == 0:
            print(json.dumps(rows_report[-1]), flush=True)

    def verify_round() -> None:
        model(decode_batch(lanes, WINDOW, vocab, rng), snapshot_rows={0: range(WINDOW)})
        restore_length(lanes[0], lanes[0].length - WINDOW)

    trace = args.out / "step_trace_verify.json.gz" if args.chrome_trace else None
    tables["_verify"], busy["verify"] = profile(
        verify_round, f"a verify round with {WINDOW - 1} drafts", rank, trace=trace
    )
    syncs = {"verify": sync_sites(verify_round), "graphs_current": graphs.covers("trunk", 1)}
    trace = args.out / "step_trace.json.gz" if args.chrome_trace else None
    tables[""], busy["1 lane"] = profile(lambda: model(decode_batch(lanes, 1, vocab, rng)), "1 lane", rank, trace=trace)
    syncs["1 lane"] = sync_sites(lambda: model(decode_batch(lanes, 1, vocab, rng)))
    if args.prompt:
        lanes = [model.new_lane()]

        def prompt_pass() -> None:
            restore_length(lanes[0], 0)
            model(decode_batch(lanes, args.prompt, vocab, rng))

        times = []
        for i in range(7):
            torch.cuda.synchronize()
            start = time.perf_counter()
            prompt_pass()
            torch.cuda.synchronize()
            if i >= 2:
                times.append((time.perf_counter() - start) * 1e3)
        prompt_report = {"rows": args.prompt, "wall_ms": statistics.median(times)}
        if rank == 0:
            print(json.dumps({"prompt": prompt_report}), flush=True)
        tables["_prompt"], busy["prompt"] = profile(prompt_pass, f"a {args.prompt}-row prompt pass", rank, rounds=3)
        syncs["prompt"] = sync_sites(prompt_pass)
        if model.mtp is not None:  # the MTP layer's pass over the same rows, as a served prompt round makes it
            tables["_prompt_mtp"], busy["prompt_mtp"] = profile(
                mtp_prompt_pass(model, lanes[0], args.prompt, vocab, rng), f"the MTP's {args.prompt}-row pass", rank,
                rounds=3,
            )  # fmt: skip
    if rank == 0:
        print(json.dumps({"host waits": syncs}), flush=True)
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        for name, table in tables.items():
            (args.out / f"step_profile{name}.txt").write_text(table)
        report = {"rows": rows, "verify": rows_report, "profiled_rounds": 5, "profiled_lanes": [1, most],
                  "context": args.context, "random_tokens": args.random_tokens, "prompt": prompt_report,
                  "alone_as": args.alone_as, "host_waits": syncs, "busy": busy}  # fmt: skip
        (args.out / "step_profile.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
