"""Front-end cost at load: N streams straight into the engine (A) and through HTTP (B); rank 0's rounds compared.

    python scripts/bench_frontend.py --clients 8 --max-tokens 8 --prompt-tokens 16      # the shipped model, on CPU
    python scripts/bench_frontend.py configs/qwen3.8-flash-next --load-format dummy --tp 2 --device cuda --json fe.json

Flags this script does not know (the model path too) are `python -m server`'s, and both phases get them. Each phase
runs in fresh processes. (A): a child of this script is rank 0, with the engine and no HTTP: it submits the requests
to the engine and takes their tokens in the engine's sink (at `--tp 2` a `python -m server` process is rank 1, as the
launcher would start it). (B): `python -m server`, and this process as the streaming clients of /v1/completions.
Prompts are seeded random token ids, decoding is greedy and ignores EOS, so every stream runs to --max-tokens; each
phase runs the workload to warm up, then once measured. Round times are the server's flashnext:round_seconds
histogram over the measured run: the mean is exact, p50 and p90 are interpolated within its 25%-wide buckets.
The front end's share of rank 0's round time is (B - A) / B.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from model.config import load_config  # noqa: E402
from rankwire.header import DrawSpec  # noqa: E402
from server.cli import build_parser  # noqa: E402
from server.engine import Engine, Request, Update  # noqa: E402
from server.ranks import free_port, rank_env, rank_environments  # noqa: E402
from server.serve import connect_ranks, create_serving, load_rank  # noqa: E402
from server.settings import read_environment  # noqa: E402
from server.tp import LinkedRunner  # noqa: E402

ROUNDS = "flashnext:round_seconds"
GREEDY = DrawSpec(0.0, 0, 1.0, 0.0, 0)


@dataclass(frozen=True, slots=True)
class Rounds:
    """A snapshot of the round-time histogram: bucket upper bounds, cumulative counts, sum and count."""

    bounds: tuple[float, ...]
    cumulative: tuple[float, ...]
    total: float
    count: float

    def minus(self, before: Rounds) -> Rounds:
        """The rounds between an earlier snapshot and this one."""
        cumulative = tuple(a - b for a, b in zip(self.cumulative, before.cumulative, strict=True))
        return Rounds(self.bounds, cumulative, self.total - before.total, self.count - before.count)

    def mean(self) -> float:
        """Mean round time in seconds (NaN without rounds)."""
        return self.total / self.count if self.count else math.nan

    def quantile(self, q: float) -> float:
        """The q-quantile, interpolated linearly within its bucket as Prometheus' histogram_quantile does."""
        if not self.count:
            return math.nan
        rank = q * self.count
        for i, (bound, cumulative) in enumerate(zip(self.bounds, self.cumulative, strict=True)):
            if cumulative >= rank:
                lower, below = (self.bounds[i - 1], self.cumulative[i - 1]) if i else (0.0, 0.0)
                if math.isinf(bound):
                    return lower
                return lower + (bound - lower) * (rank - below) / (cumulative - below)
        return self.bounds[-2]


@dataclass(slots=True)
class Stream:
    """One request as its consumer saw it: tokens, the times of its first and last tokens, how it ended."""

    tokens: int = 0
    first: float = math.nan
    last: float = math.nan
    finish: str | None = None

    def add(self, count: int, now: float) -> None:
        """Count `count` tokens that arrived at `now`."""
        if count and not self.tokens:
            self.first = now
        if count:
            self.tokens += count
            self.last = now


def parse_args(argv: list[str]) -> argparse.Namespace:
    """This script's flags; the rest, checked by the server's own parser, go to `python -m server`."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--clients", type=int, default=64, help="concurrent streams (default %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens per stream (default %(default)s)")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="prompt ids per stream (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured runs first (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default %(default)s)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds for one run (default %(default)s)")
    parser.add_argument(
        "--start-timeout", type=float, default=600, help="seconds for the server to come up (default %(default)s)"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results here (default none)")
    parser.add_argument("--engine-only", type=Path, default=None, help=argparse.SUPPRESS)  # (A)'s child writes here
    args, server_args = parser.parse_known_args(argv)
    args.server_args = server_args
    args.serve = build_parser().parse_args(["serve", *server_args])
    return args


def make_prompts(vocab: int, count: int, length: int, seed: int, run: int) -> list[list[int]]:
    """Seeded random token ids, different for every run (so no run resumes another's kept prompts)."""
    rng = random.Random(f"{seed}/{run}")
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]


def workloads(args: argparse.Namespace) -> list[list[list[int]]]:
    """The prompts of each run, the warm-up runs first."""
    vocab = load_config(args.serve.model).vocab_size
    return [make_prompts(vocab, args.clients, args.prompt_tokens, args.seed, run) for run in range(args.warmup + 1)]


def read_rounds(metrics_text: str) -> Rounds:
    """The round-time histogram from /metrics text."""
    for family in text_string_to_metric_families(metrics_text):
        if family.name == ROUNDS:
            buckets = [(float(s.labels["le"]), s.value) for s in family.samples if s.name == f"{ROUNDS}_bucket"]
            values = {s.name: s.value for s in family.samples}
            bounds, cumulative = zip(*sorted(buckets), strict=True)
            return Rounds(bounds, cumulative, values[f"{ROUNDS}_sum"], values[f"{ROUNDS}_count"])
    raise RuntimeError(f"the server's metrics have no {ROUNDS}")


def aggregate_tok_s(streams: list[Stream]) -> float:
    """Sum of (tokens - 1) over the span from the first token of any stream to the last token of any stream."""
    span = max(s.last for s in streams) - min(s.first for s in streams)
    return sum(s.tokens - 1 for s in streams) / span if span > 0 else math.nan


def summarize(rounds: Rounds, streams: list[Stream], max_tokens: int) -> dict[str, float]:
    """One phase's figures; every stream must have run to max_tokens."""
    short = [s for s in streams if s.finish != "length" or s.tokens != max_tokens]
    if short:
        raise RuntimeError(f"{len(short)} streams did not run to max_tokens: {short[0]}")
    return {
        "rounds": rounds.count,
        "round_mean_ms": rounds.mean() * 1e3,
        "round_p50_ms": rounds.quantile(0.5) * 1e3,
        "round_p90_ms": rounds.quantile(0.9) * 1e3,
        "round_total_s": rounds.total,
        "tokens": sum(s.tokens for s in streams),
        "aggregate_tok_s": aggregate_tok_s(streams),
    }


def shares(engine: dict[str, float], http: dict[str, float]) -> dict[str, float]:
    """(B - A) / B of the mean round time, and of the total round time of the run."""
    return {
        "front_end_share_of_mean_round": (http["round_mean_ms"] - engine["round_mean_ms"]) / http["round_mean_ms"],
        "front_end_share_of_total_round_time": (http["round_total_s"] - engine["round_total_s"])
        / http["round_total_s"],
    }


def table(engine: dict[str, float], http: dict[str, float], share: dict[str, float]) -> str:
    """The report: both phases side by side, then the shares."""
    rows = [f"{'':24}{'A engine':>12}{'B http':>12}"]
    for key, label, digits in (
        ("rounds", "rounds", 0),
        ("round_mean_ms", "round mean (ms)", 2),
        ("round_p50_ms", "round p50 (ms)", 2),
        ("round_p90_ms", "round p90 (ms)", 2),
        ("round_total_s", "round time total (s)", 3),
        ("tokens", "tokens", 0),
        ("aggregate_tok_s", "aggregate (tok/s)", 1),
    ):
        rows.append(f"{label:24}{engine[key]:>12.{digits}f}{http[key]:>12.{digits}f}")
    rows.append(f"front end share of the mean round (B - A) / B: {share['front_end_share_of_mean_round']:.1%}")
    rows.append(f"front end share of the total round time:       {share['front_end_share_of_total_round_time']:.1%}")
    return "\n".join(rows)


def run_engine(engine: Engine, prompts: list[list[int]], max_tokens: int, run: int, timeout: float) -> list[Stream]:
    """Submit every prompt at once and take the tokens in the engine's sink, with no HTTP."""
    streams = [Stream() for _ in prompts]
    done = [threading.Event() for _ in prompts]

    def sink_for(i: int):
        """Stream i's sink: count, stamp, and mark the end."""

        def sink(update: Update) -> None:
            streams[i].add(len(update.token_ids), time.perf_counter())
            if update.finish_reason is not None:
                streams[i].finish = update.error or update.finish_reason
                done[i].set()

        return sink

    for i, prompt in enumerate(prompts):
        engine.submit(Request(f"r{run}-{i}", prompt, max_tokens, GREEDY, frozenset(), sink_for(i)))
    deadline = time.monotonic() + timeout
    for event in done:
        if not event.wait(max(deadline - time.monotonic(), 0)):
            raise RuntimeError(f"run {run}: the engine did not finish within {timeout} s")
    return streams


def engine_phase(args: argparse.Namespace) -> dict[str, float]:
    """(A) as rank 0: the serve flags' engine in this process, driven with no HTTP."""
    serve = args.serve
    env = read_environment(os.environ)
    ranks = rank_env(serve.tp)
    link = connect_ranks(serve, ranks, env) if ranks.world > 1 else None
    runner = load_rank(serve, ranks, env)
    state = create_serving(serve, runner.model, LinkedRunner(runner, link, env.tp_timeout_s) if link else runner)
    state.engine.start()
    try:
        for run, prompts in enumerate(workloads(args)):  # the last run is the measured one
            before = read_rounds(state.metrics.render().decode())
            streams = run_engine(state.engine, prompts, args.max_tokens, run, args.timeout)
            rounds = read_rounds(state.metrics.render().decode()).minus(before)
    finally:
        state.engine.stop()
    return summarize(rounds, streams, args.max_tokens)


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child process: this checkout importable, no progress bars."""
    path = f"{ROOT}{os.pathsep}{os.environ['PYTHONPATH']}" if os.environ.get("PYTHONPATH") else str(ROOT)
    return {**os.environ, "PYTHONPATH": path, "TQDM_DISABLE": "1", **extra}


def stop(proc: subprocess.Popen) -> None:
    """Ask a process to shut down (SIGTERM), and kill it if it has not within a minute."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_phase_a(args: argparse.Namespace, argv: list[str]) -> dict[str, float]:
    """(A) in fresh processes: this script as rank 0 with --engine-only, and `python -m server` as rank 1 at tp 2."""
    world = args.serve.tp or 1
    envs = rank_environments(world, {}) if world > 1 else [{}]  # torchrun's variables and a checked link port
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "engine.json"
        rank0 = [sys.executable, str(Path(__file__).resolve()), *argv, "--engine-only", str(out)]
        procs = [subprocess.Popen(rank0, cwd=ROOT, env=child_env(**envs[0]))]
        for rank in range(1, world):
            server = [sys.executable, "-m", "server", *args.server_args]
            procs.append(subprocess.Popen(server, cwd=ROOT, env=child_env(**envs[rank])))
        try:
            while procs[0].poll() is None and all(p.poll() in (None, 0) for p in procs[1:]):
                time.sleep(0.2)
        finally:
            for proc in procs:  # rank 1 stops when rank 0's engine does; a rank left waiting on a dead peer is ended
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    stop(proc)
        if procs[0].returncode != 0:
            raise RuntimeError(f"(A) rank 0 exited with {procs[0].returncode}")
        return json.loads(out.read_text())


async def stream_one(client: httpx.AsyncClient, url: str, body: dict[str, Any], stream: Stream) -> None:
    """Stream one completion, counting its token ids as their SSE events arrive."""
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            for choice in event["choices"]:
                stream.add(len(choice.get("token_ids") or ()), time.perf_counter())
                stream.finish = choice["finish_reason"] or stream.finish


async def run_clients(url: str, prompts: list[list[int]], args: argparse.Namespace) -> list[Stream]:
    """All streams at once from one event loop."""
    streams = [Stream() for _ in prompts]
    headers = {"Authorization": f"Bearer {args.serve.api_key[0]}"} if args.serve.api_key else {}  # the first key
    limits = httpx.Limits(max_connections=len(prompts))
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits, headers=headers, trust_env=False) as client:
        bodies = [
            {
                "prompt": prompt,
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "return_token_ids": True,
            }
            for prompt in prompts
        ]
        await asyncio.gather(*(stream_one(client, url, b, s) for b, s in zip(bodies, streams, strict=True)))
    return streams


def wait_up(url: str, server: subprocess.Popen, timeout: float) -> None:
    """Wait until /health answers; fail if the server exits first or takes too long."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"(B) the server exited with {server.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"(B) the server did not come up within {timeout} s")


def scrape(url: str) -> Rounds:
    """The server's round-time histogram now."""
    return read_rounds(httpx.get(f"{url}/metrics", timeout=30, trust_env=False).text)


def run_phase_b(args: argparse.Namespace) -> dict[str, float]:
    """(B): the server in its own processes, this process as the streaming clients."""
    port = free_port()
    cmd = [sys.executable, "-m", "server", *args.server_args, "--host", "127.0.0.1", "--port", str(port)]
    server = subprocess.Popen(cmd, cwd=ROOT, env=child_env())
    url = f"http://127.0.0.1:{port}"
    try:
        wait_up(url, server, args.start_timeout)
        for prompts in workloads(args):  # the last run is the measured one
            before = scrape(url)
            streams = asyncio.run(run_clients(url, prompts, args))
            rounds = scrape(url).minus(before)
    finally:
        stop(server)
    return summarize(rounds, streams, args.max_tokens)


def main(argv: list[str] | None = None) -> int:
    """Run (A) and (B) one after the other, print the table, and write --json if asked."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.engine_only is not None:
        args.engine_only.write_text(json.dumps(engine_phase(args)))
        return 0
    engine = run_phase_a(args, argv)
    http = run_phase_b(args)
    share = shares(engine, http)
    print(table(engine, http, share))
    if args.json is not None:
        config = {k: getattr(args, k) for k in ("clients", "max_tokens", "prompt_tokens", "warmup", "seed")}
        result = {**config, "server_args": args.server_args, "engine": engine, "http": http, **share}
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
