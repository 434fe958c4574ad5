"""Concurrent-stream benchmark: N streams start together; optionally check each against its alone and draft-off runs.

    python scripts/bench_concurrent.py --levels 1,4,8 --alone
    python scripts/bench_concurrent.py --random-prompt 128 --vocab 200000 --tokens 128 --drafts both --json
    python scripts/bench_concurrent.py --levels 1,64 --extra '{"frequency_penalty": 0.5}'

With --random-prompt N each stream sends its own N random token ids to /v1/completions, so a server without a
tokenizer can be measured; otherwise every stream sends --prompt as a chat message. Every timed request carries a
cache_salt of its own, so none resumes a prompt state that the warm-up or another request left in the server's cache.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import uuid
from dataclasses import dataclass
from typing import Any

import httpx
from openai_stream import (
    DEFAULT_BASE_URL,
    DEFAULT_TIMEOUT,
    StreamError,
    StreamResult,
    chat_body,
    completion_body,
    float_list,
    int_list,
    open_client,
    resolve_model,
    stream_chat,
    stream_completion,
)

DEFAULT_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


@dataclass
class Stream:
    """One stream of one concurrent run, with the request that made it."""

    temperature: float
    drafts: str
    level: int
    rep: int
    index: int
    body: dict[str, Any]
    result: StreamResult

    @property
    def name(self) -> str:
        """Where the stream ran, for report lines."""
        where = f"T={self.temperature:g} drafts {self.drafts} N={self.level} rep {self.rep} stream {self.index}"
        return f"{where} seed {self.body.get('seed')}"


def json_object(text: str) -> dict[str, Any]:
    """A JSON object given on the command line."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base-url", default=DEFAULT_BASE_URL, help="server address (default: %(default)s)")
    parser.add_argument("--model", help="model name (default: the first one GET /v1/models lists)")
    parser.add_argument("--api-key", help="bearer token sent to the server (default: none)")
    parser.add_argument(
        "--levels", type=int_list, default=[1, 4, 8], help="comma-separated stream counts (default: 1,4,8)"
    )
    parser.add_argument("--tokens", type=int, default=256, help="completion tokens per stream (default: %(default)s)")
    parser.add_argument("--reps", type=int, default=3, help="concurrent runs per level (default: %(default)s)")
    parser.add_argument(
        "--temperatures", type=float_list, default=[1.0, 0.0], help="comma-separated temperatures (default: 1.0,0)"
    )
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="the prompt every stream sends (default: a story)")
    parser.add_argument(
        "--random-prompt",
        type=int,
        help="stream i sends N random token ids seeded from seed and i to /v1/completions instead (default: off)",
    )
    parser.add_argument("--vocab", type=int, default=4096, help="random ids are below this (default: %(default)s)")
    parser.add_argument(
        "--seed",
        type=int,
        default=1234,
        help="stream i samples with seed + i and draws its random prompt from (seed, i) (default: %(default)s)",
    )
    parser.add_argument(
        "--drafts",
        choices=("on", "off", "both"),
        default="on",
        help='on: the server drafts as configured; off: every request sends "draft": false; both: each level '
        "runs with and then without (default: %(default)s)",
    )
    parser.add_argument("--top-k", type=int, default=20, help="top_k when sampling (default: %(default)s)")
    parser.add_argument("--top-p", type=float, default=0.95, help="top_p when sampling (default: %(default)s)")
    parser.add_argument("--thinking", action="store_true", help="turn the chat template's thinking on (default: off)")
    parser.add_argument(
        "--alone", action="store_true", help="afterwards run each request alone and compare token_sha (default: off)"
    )
    parser.add_argument(
        "--serial",
        action="store_true",
        help='also run each alone request with "draft": false and compare; implies --alone (default: off)',
    )
    parser.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds per request (default: %(default)s)"
    )
    parser.add_argument(
        "--extra",
        type=json_object,
        default={},
        help="a JSON object merged into every request body, e.g. '{\"logprobs\": 5}' (default: none)",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON summary on the last line (default: off)")
    args = parser.parse_args(argv)
    if args.random_prompt is not None and args.random_prompt < 1:
        parser.error("--random-prompt: must be at least 1")
    if args.vocab < 1:
        parser.error("--vocab: must be at least 1")
    return args


def send(args: argparse.Namespace, body: dict[str, Any], client: httpx.Client | None = None) -> StreamResult:
    """Stream one request: a token-id prompt from /v1/completions, messages from /v1/chat/completions."""
    stream = stream_completion if "prompt" in body else stream_chat
    return stream(args.base_url, body, args.api_key, args.timeout, client)


def run_together(args: argparse.Namespace, bodies: list[dict[str, Any]]) -> list[StreamResult]:
    """Start one stream per body at the same moment (a barrier) and wait for all of them."""
    barrier = threading.Barrier(len(bodies))
    results: list[StreamResult | None] = [None] * len(bodies)
    errors: list[Exception] = []

    def work(i: int) -> None:
        """Make a client, wait for the others, then stream body i (a client made after the barrier staggers starts)."""
        try:
            with open_client(args.timeout) as client:
                barrier.wait()
                results[i] = send(args, bodies[i], client)
        except Exception as exc:
            errors.append(exc)
            barrier.abort()  # so no other stream waits for this one forever

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(bodies))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return [r for r in results if r is not None]


def aggregate_tok_s(results: list[StreamResult]) -> float | None:
    """Sum of (tokens - 1) over the span from the first token of any stream to the last token of any stream."""
    timed = [r for r in results if r.piece_times]
    if not timed:
        return None
    span = max(r.piece_times[-1] for r in timed) - min(r.piece_times[0] for r in timed)
    return sum(r.tokens - 1 for r in timed) / span if span > 0 else None


def output_tok_s(results: list[StreamResult]) -> float | None:
    """Every completion token over the span from the first request sent to the last token (vLLM's and SGLang's output
    throughput): unlike aggregate_tok_s it pays for the prompts and the first tokens."""
    timed = [r for r in results if r.piece_times]
    if not timed:
        return None
    span = max(r.piece_times[-1] for r in timed) - min(r.started for r in results)
    return sum(r.tokens for r in timed) / span if span > 0 else None


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0 to 100), interpolated between ranks; None without values."""
    if not values:
        return None
    ordered = sorted(values)
    where = (len(ordered) - 1) * q / 100
    low = int(where)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (where - low)


def show(value: float | None, scale: float, unit: str) -> str:
    """A number for the report, or n/a."""
    return "n/a" if value is None else f"{value * scale:.1f} {unit}"


def same(name: str, first: str | None, second: str | None, what: str) -> bool:
    """Compare two token_sha values, printing a MISMATCH line when they differ or one is missing."""
    if first is not None and first == second:
        return True
    print(f"MISMATCH {name}: {what} {first} vs {second}")
    return False


def check_alone(args: argparse.Namespace, streams: list[Stream]) -> tuple[int, int]:
    """Run each distinct request alone (a drafted one also with draft off if asked); return (checks, mismatches)."""
    alone: dict[str, str | None] = {}
    serial_checked: set[str] = set()

    def alone_sha(body: dict[str, Any]) -> str | None:
        """token_sha of body run alone; each distinct body runs once."""
        key = json.dumps(body, sort_keys=True)
        if key not in alone:
            alone[key] = send(args, body).token_sha
        return alone[key]

    checked = mismatched = 0
    for stream in streams:
        body = {k: v for k, v in stream.body.items() if k != "cache_salt"}  # the same request, whichever run sent it
        sha = alone_sha(body)
        key = json.dumps(body, sort_keys=True)
        if args.serial and stream.drafts == "on" and key not in serial_checked:
            serial_checked.add(key)
            serial = alone_sha({**body, "draft": False})
            checked += 1
            mismatched += not same(stream.name, sha, serial, 'alone vs "draft": false')
        checked += 1
        mismatched += not same(stream.name, stream.result.token_sha, sha, "concurrent vs alone")
    return checked, mismatched


def random_ids(args: argparse.Namespace, index: int) -> list[int]:
    """Stream index's random prompt: its own ids, so streams share no cached prompt state."""
    draw = random.Random(f"{args.seed}/{index}")
    return [draw.randrange(args.vocab) for _ in range(args.random_prompt)]


def stream_body(args: argparse.Namespace, model: str, temperature: float, drafts: str, index: int) -> dict[str, Any]:
    """Stream index's request at this temperature (seed + index when sampling), with "draft": false when off."""
    if args.random_prompt:
        body = completion_body(
            model, random_ids(args, index), args.tokens, temperature, args.seed + index, args.top_k, args.top_p
        )
    else:
        body = chat_body(
            model, args.prompt, args.tokens, temperature, args.seed + index, args.top_k, args.top_p, args.thinking
        )
    body = {**body, **args.extra}
    return body if drafts == "on" else {**body, "draft": False}


def run_rep(
    args: argparse.Namespace, model: str, temperature: float, drafts: str, level: int, rep: int
) -> tuple[list[Stream], dict[str, Any]]:
    """One concurrent run of level streams: print it and return its streams and its JSON record."""
    # a salt of its own per request: no stream resumes a prompt state kept by the warm-up, another run or stream
    bodies = [
        {**stream_body(args, model, temperature, drafts, i), "cache_salt": uuid.uuid4().hex} for i in range(level)
    ]
    results = run_together(args, bodies)
    batch = [
        Stream(temperature, drafts, level, rep, i, b, r) for i, (b, r) in enumerate(zip(bodies, results, strict=True))
    ]
    total, output = aggregate_tok_s(results), output_tok_s(results)
    print(
        f"T={temperature:g} drafts {drafts} N={level} rep {rep}: aggregate {show(total, 1, 'tok/s')},"
        f" output {show(output, 1, 'tok/s')}"
    )
    record: dict[str, Any] = {
        "temperature": temperature,
        "drafts": drafts,
        "level": level,
        "rep": rep,
        "aggregate_tok_s": total,
        "output_tok_s": output,
    }
    record["streams"] = []
    for s in batch:
        r = s.result
        print(
            f"  stream {s.index} seed {s.body.get('seed')}: {show(r.decode_tok_s, 1, 'tok/s')},"
            f" TTFT {show(r.ttft, 1e3, 'ms')}, {r.tokens} tokens, token_sha {r.token_sha}"
        )
        if r.is_short(args.tokens):
            print(f"  SHORT: stream {s.index} ended after {r.tokens} of {args.tokens} tokens ({r.finish_reason})")
        record["streams"].append(
            {
                "seed": s.body.get("seed"),
                "decode_tok_s": r.decode_tok_s,
                "ttft_s": r.ttft,
                "tokens": r.tokens,
                "prompt_tokens": (r.usage or {}).get("prompt_tokens"),
                "token_sha": r.token_sha,
                "finish_reason": r.finish_reason,
            }
        )
    return batch, record


def summarize(streams: list[Stream]) -> list[dict[str, Any]]:
    """Per (temperature, drafts, level): median aggregate over reps, stream speed, TTFT median and p90, ITL median."""
    cells: dict[tuple[float, str, int], list[Stream]] = {}
    for stream in streams:
        cells.setdefault((stream.temperature, stream.drafts, stream.level), []).append(stream)
    summary = []
    for (temperature, drafts, level), cell in cells.items():
        reps = sorted({s.rep for s in cell})
        totals = [aggregate_tok_s([s.result for s in cell if s.rep == rep]) for rep in reps]
        outputs = [output_tok_s([s.result for s in cell if s.rep == rep]) for rep in reps]
        speeds = [s.result.decode_tok_s for s in cell]
        ttfts = [s.result.ttft for s in cell]
        entry = {
            "temperature": temperature,
            "drafts": drafts,
            "level": level,
            "reps": len(reps),
            "aggregate_tok_s": percentile([t for t in totals if t is not None], 50),
            "output_tok_s": percentile([t for t in outputs if t is not None], 50),
            "stream_tok_s_median": percentile([v for v in speeds if v is not None], 50),
            "ttft_s_median": percentile([t for t in ttfts if t is not None], 50),
            "ttft_s_p90": percentile([t for t in ttfts if t is not None], 90),
            "itl_s_median": percentile([gap for s in cell for gap in s.result.token_gaps], 50),
        }
        print(
            f"T={temperature:g} drafts {drafts} N={level}: aggregate {show(entry['aggregate_tok_s'], 1, 'tok/s')},"
            f" output {show(entry['output_tok_s'], 1, 'tok/s')},"
            f" per stream {show(entry['stream_tok_s_median'], 1, 'tok/s')},"
            f" TTFT median {show(entry['ttft_s_median'], 1e3, 'ms')} p90 {show(entry['ttft_s_p90'], 1e3, 'ms')},"
            f" ITL median {show(entry['itl_s_median'], 1e3, 'ms')}"
        )
        summary.append(entry)
    return summary


def main(argv: list[str] | None = None) -> int:
    """Run every (temperature, level, drafts, rep), report speeds, hashes and a summary, then the comparisons asked."""
    args = parse_args(argv)
    settings = ["on", "off"] if args.drafts == "both" else [args.drafts]
    streams: list[Stream] = []
    runs: list[dict[str, Any]] = []
    checked = mismatched = 0
    try:
        model = args.model or resolve_model(args.base_url, args.api_key, args.timeout)
        for temperature in args.temperatures:
            for drafts in settings:
                send(args, stream_body(args, model, temperature, drafts, 0))  # warm-up
            for level in args.levels:
                for drafts in settings:
                    for rep in range(1, args.reps + 1):
                        batch, record = run_rep(args, model, temperature, drafts, level, rep)
                        streams.extend(batch)
                        runs.append(record)
        summary = summarize(streams)
        if args.alone or args.serial:
            checked, mismatched = check_alone(args, streams)
            print(f"comparisons: {checked}, mismatches: {mismatched}")
    except StreamError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    short = sum(s.result.is_short(args.tokens) for s in streams)
    if short:
        print(f"{short} streams ended before {args.tokens} tokens: their levels' figures ran a lighter load")
    if args.json:
        setup = {"base_url": args.base_url, "model": model, "tokens": args.tokens, "random_prompt": args.random_prompt}
        report = {**setup, "runs": runs, "summary": summary, "comparisons": checked, "mismatches": mismatched}
        print(json.dumps({**report, "short_streams": short}))
    return 1 if mismatched or short else 0


if __name__ == "__main__":
    sys.exit(main())
