"""Guided decoding benchmark: what a grammar costs a served request, against the same requests unguided.

    python scripts/bench_guided.py --requests 8 --tokens 128 --concurrency 1 4

Each request asks for exactly `--tokens` tokens of one prompt (seeded, sampled, its own seed): `plain` without a
guide (ignore_eos), `guided` under `guided_regex` `[a-z ,.]{1000}`, which never completes inside `--tokens` tokens,
so both run to their length. Prints one line per mode and concurrency (output tokens a second over the run, the mean
request latency) and, with --json, a JSON list of them last. Every answer is checked to hold `--tokens` tokens, and
every guided answer's text to stay inside the pattern's characters.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import httpx
from openai_stream import DEFAULT_BASE_URL, DEFAULT_TIMEOUT, resolve_model

PATTERN = "[a-z ,.]{1000}"
PROMPT = "Write a short story about a lighthouse keeper.\n\n"


@dataclass(frozen=True, slots=True)
class ModeResult:
    """One mode's run at one concurrency: output tokens a second over the run, and each request's mean latency."""

    mode: str
    requests: int
    tokens: int
    concurrency: int
    wall_s: float
    output_tok_s: float
    mean_latency_s: float


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=DEFAULT_BASE_URL)
    parser.add_argument("--requests", type=int, default=8, help="requests a mode sends (default 8)")
    parser.add_argument("--tokens", type=int, default=128, help="tokens each request asks for (default 128)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4], help="requests in flight (default 1 4)")
    parser.add_argument("--json", action="store_true", help="print the results as a JSON list last")
    args = parser.parse_args(argv)
    for name in ("requests", "tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}: must be at least 1")
    if min(args.concurrency) < 1:
        parser.error("--concurrency: each must be at least 1")
    return args


def run_mode(args: argparse.Namespace, model: str, mode: str, concurrency: int) -> ModeResult:
    """Send `args.requests` requests, `concurrency` at a time, each for `args.tokens` tokens, guided or not."""
    guide = {"guided_regex": PATTERN} if mode == "guided" else {"ignore_eos": True}
    url = f"{args.base_url.rstrip('/')}/v1/completions"

    def one(index: int) -> float:
        body = {"model": model, "prompt": PROMPT, "max_tokens": args.tokens, "temperature": 0.8, "seed": index,
                "return_token_ids": True, **guide}  # fmt: skip
        start = time.perf_counter()
        reply = httpx.post(url, json=body, timeout=DEFAULT_TIMEOUT)
        reply.raise_for_status()
        choice = reply.json()["choices"][0]
        if len(choice["token_ids"]) != args.tokens:
            raise RuntimeError(f"{mode}: {len(choice['token_ids'])} tokens, not {args.tokens}")
        if mode == "guided" and not re.fullmatch("[a-z ,.]*", choice["text"]):
            raise RuntimeError(f"guided text left the pattern: {choice['text'][:80]!r}")
        return time.perf_counter() - start

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        latencies = list(pool.map(one, range(args.requests)))
    wall = time.perf_counter() - start
    total = args.requests * args.tokens
    return ModeResult(
        mode, args.requests, args.tokens, concurrency, wall, total / wall, sum(latencies) / len(latencies)
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = resolve_model(args.base_url)
    run_mode(args, model, "guided", 1)  # warm-up: the grammar's masks and the first rounds' compiles
    results = []
    for concurrency in args.concurrency:
        for mode in ("plain", "guided"):
            result = run_mode(args, model, mode, concurrency)
            results.append(result)
            print(f"{mode:7s} concurrency {concurrency:3d}: {result.output_tok_s:8.1f} output tok/s, "
                  f"mean latency {result.mean_latency_s:6.3f} s over {result.wall_s:.2f} s", flush=True)  # fmt: skip
    if args.json:
        print(json.dumps([asdict(r) for r in results]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
