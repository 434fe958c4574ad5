"""Concurrent-stream benchmark: N streams start together; optionally check each against its alone and draft-off runs."""

from __future__ import annotations

import argparse
import json
import sys
import threading
from dataclasses import dataclass
from typing import Any

from openai_stream import (
    DEFAULT_BASE_URL,
    DEFAULT_TIMEOUT,
    StreamError,
    StreamResult,
    chat_body,
    float_list,
    int_list,
    resolve_model,
    stream_chat,
)

DEFAULT_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


@dataclass
class Stream:
    """One stream of one concurrent run, with the request that made it."""

    temperature: float
    level: int
    rep: int
    index: int
    body: dict[str, Any]
    result: StreamResult

    @property
    def name(self) -> str:
        """Where the stream ran, for report lines."""
        return f"T={self.temperature:g} N={self.level} rep {self.rep} stream {self.index} seed {self.body.get('seed')}"


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
    parser.add_argument("--seed", type=int, default=1234, help="stream i samples with seed + i (default: %(default)s)")
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
    parser.add_argument("--json", action="store_true", help="print a JSON summary on the last line (default: off)")
    return parser.parse_args(argv)


def run_together(args: argparse.Namespace, bodies: list[dict[str, Any]]) -> list[StreamResult]:
    """Start one stream per body at the same moment (a barrier) and wait for all of them."""
    barrier = threading.Barrier(len(bodies))
    results: list[StreamResult | None] = [None] * len(bodies)
    errors: list[Exception] = []

    def work(i: int) -> None:
        """Wait for the others, then stream body i."""
        try:
            barrier.wait()
            results[i] = stream_chat(args.base_url, bodies[i], args.api_key, args.timeout)
        except Exception as exc:
            errors.append(exc)

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
    """Run each distinct request alone (and with draft off if asked); return (comparisons, mismatches)."""
    alone: dict[str, str | None] = {}
    checked = mismatched = 0
    for stream in streams:
        key = json.dumps(stream.body, sort_keys=True)
        if key not in alone:
            alone[key] = stream_chat(args.base_url, stream.body, args.api_key, args.timeout).token_sha
            if args.serial:
                serial = stream_chat(args.base_url, {**stream.body, "draft": False}, args.api_key, args.timeout)
                checked += 1
                mismatched += not same(stream.name, alone[key], serial.token_sha, 'alone vs "draft": false')
        checked += 1
        mismatched += not same(stream.name, stream.result.token_sha, alone[key], "concurrent vs alone")
    return checked, mismatched


def stream_body(args: argparse.Namespace, model: str, temperature: float, index: int) -> dict[str, Any]:
    """Stream index's request at this temperature (seed + index when sampling)."""
    return chat_body(
        model, args.prompt, args.tokens, temperature, args.seed + index, args.top_k, args.top_p, args.thinking
    )


def run_rep(
    args: argparse.Namespace, model: str, temperature: float, level: int, rep: int
) -> tuple[list[Stream], dict[str, Any]]:
    """One concurrent run of level streams: print it and return its streams and its JSON record."""
    bodies = [stream_body(args, model, temperature, i) for i in range(level)]
    results = run_together(args, bodies)
    batch = [Stream(temperature, level, rep, i, b, r) for i, (b, r) in enumerate(zip(bodies, results, strict=True))]
    total = aggregate_tok_s(results)
    print(f"T={temperature:g} N={level} rep {rep}: aggregate {show(total, 1, 'tok/s')}")
    record: dict[str, Any] = {"temperature": temperature, "level": level, "rep": rep, "aggregate_tok_s": total}
    record["streams"] = []
    for s in batch:
        r = s.result
        print(
            f"  stream {s.index} seed {s.body.get('seed')}: {show(r.decode_tok_s, 1, 'tok/s')},"
            f" TTFT {show(r.ttft, 1e3, 'ms')}, {r.tokens} tokens, token_sha {r.token_sha}"
        )
        record["streams"].append(
            {
                "seed": s.body.get("seed"),
                "decode_tok_s": r.decode_tok_s,
                "ttft_s": r.ttft,
                "tokens": r.tokens,
                "token_sha": r.token_sha,
            }
        )
    return batch, record


def main(argv: list[str] | None = None) -> int:
    """Run every (temperature, level, rep), report speeds and hashes, then the comparisons asked for."""
    args = parse_args(argv)
    streams: list[Stream] = []
    runs: list[dict[str, Any]] = []
    checked = mismatched = 0
    try:
        model = args.model or resolve_model(args.base_url, args.api_key, args.timeout)
        for temperature in args.temperatures:
            stream_chat(args.base_url, stream_body(args, model, temperature, 0), args.api_key, args.timeout)  # warm-up
            for level in args.levels:
                for rep in range(1, args.reps + 1):
                    batch, record = run_rep(args, model, temperature, level, rep)
                    streams.extend(batch)
                    runs.append(record)
        if args.alone or args.serial:
            checked, mismatched = check_alone(args, streams)
            print(f"comparisons: {checked}, mismatches: {mismatched}")
    except StreamError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        summary = {"base_url": args.base_url, "model": model, "tokens": args.tokens, "runs": runs}
        print(json.dumps({**summary, "comparisons": checked, "mismatches": mismatched}))
    return 1 if mismatched else 0


if __name__ == "__main__":
    sys.exit(main())
