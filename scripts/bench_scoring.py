"""Prompt scoring benchmark: prompts of random token ids sent for their prompt logprobs (what an evaluation harness's
loglikelihood asks for), against the same prompts sent for one token without them.

    python scripts/bench_scoring.py --prompts 32 --length 1024 --vocab 200000 --concurrency 8 --prompt-logprobs 1

Each request asks for one token (`max_tokens` 1) of its own prompt under a cache_salt of its own, so no prompt state
is resumed; `plain` runs them without `prompt_logprobs`, `scored` with. Prints one line per mode (prompt tokens a
second, the mean request latency) and, with --json, a JSON list of them last. Every scored answer is checked to
carry one entry per prompt token.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import httpx
from openai_stream import DEFAULT_BASE_URL, DEFAULT_TIMEOUT, open_client, resolve_model


@dataclass(frozen=True, slots=True)
class ModeResult:
    """One mode's run: how many prompt tokens a second the server took, and each request's mean latency."""

    mode: str
    prompts: int
    length: int
    concurrency: int
    wall_s: float
    prompt_tok_s: float
    mean_latency_s: float


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=DEFAULT_BASE_URL)
    parser.add_argument("--prompts", type=int, default=32, help="prompts a mode sends (default 32)")
    parser.add_argument("--length", type=int, default=1024, help="tokens a prompt holds (default 1024)")
    parser.add_argument("--vocab", type=int, default=4096, help="token ids are drawn below this (default 4096)")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight at once (default 8)")
    parser.add_argument("--prompt-logprobs", type=int, default=1, help="most likely ids with each entry (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts' ids (default 0)")
    parser.add_argument("--json", action="store_true", help="print the results as a JSON list last")
    args = parser.parse_args(argv)
    for name in ("prompts", "length", "vocab", "concurrency"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}: must be at least 1")
    return args


def run_mode(args: argparse.Namespace, model: str, mode: str, prompts: list[list[int]]) -> ModeResult:
    """Send every prompt, `args.concurrency` at a time, for one token; with its prompt logprobs where `mode` is
    scored (each answer checked to hold one entry per prompt token)."""
    extra = {"prompt_logprobs": args.prompt_logprobs} if mode == "scored" else {}
    url = f"{args.base_url.rstrip('/')}/v1/completions"

    def one(client: httpx.Client, prompt: list[int]) -> float:
        body = {"model": model, "prompt": prompt, "max_tokens": 1, "cache_salt": uuid.uuid4().hex, **extra}
        begin = time.perf_counter()
        response = client.post(url, json=body)
        latency = time.perf_counter() - begin
        if response.status_code != 200:
            raise SystemExit(f"{mode}: HTTP {response.status_code}: {response.text[:200]}")
        entries = response.json()["choices"][0].get("prompt_logprobs")
        if mode == "scored" and len(entries or ()) != len(prompt):
            raise SystemExit(f"scored: {len(entries or ())} prompt logprob entries for {len(prompt)} tokens")
        return latency

    with open_client(DEFAULT_TIMEOUT, args.concurrency) as client, ThreadPoolExecutor(args.concurrency) as pool:
        begin = time.perf_counter()
        latencies = list(pool.map(lambda prompt: one(client, prompt), prompts))
        wall = time.perf_counter() - begin
    tokens = sum(map(len, prompts))
    return ModeResult(
        mode, len(prompts), args.length, args.concurrency, wall, tokens / wall, sum(latencies) / len(latencies)
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = resolve_model(args.base_url)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(args.vocab) for _ in range(args.length)] for _ in range(args.prompts)]
    run_mode(args, model, "plain", prompts[:1])  # warm: the first pass of each shape pays for its compiles
    run_mode(args, model, "scored", prompts[:1])
    results = [run_mode(args, model, mode, prompts) for mode in ("plain", "scored", "plain", "scored")]
    for result in results:
        print(
            f"{result.mode}: {result.prompts} prompts of {result.length} tokens, {result.concurrency} at once: "
            f"{result.prompt_tok_s:,.0f} prompt tok/s, mean latency {result.mean_latency_s * 1000:.1f} ms",
            flush=True,
        )
    if args.json:
        print(json.dumps([asdict(result) for result in results]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
