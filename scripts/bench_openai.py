"""Single-stream benchmark: median decode tok/s and time to first token per (prompt, temperature) cell."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import uuid
from typing import Any

from openai_stream import (
    DEFAULT_BASE_URL,
    DEFAULT_TIMEOUT,
    StreamError,
    StreamResult,
    chat_body,
    float_list,
    resolve_model,
    stream_chat,
)

DEFAULT_PROMPTS = {
    "code": (
        "def binary_search(items: list[int], target: int) -> int:\n"
        '    """Return the index of target in the sorted list items, or -1 when it is absent."""\n'
    ),
    "chat": "Why does caching keys and values make a transformer decode faster? Explain it in a few paragraphs.",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base-url", default=DEFAULT_BASE_URL, help="server address (default: %(default)s)")
    parser.add_argument("--model", help="model name (default: the first one GET /v1/models lists)")
    parser.add_argument("--api-key", help="bearer token sent to the server (default: none)")
    parser.add_argument("--tokens", type=int, default=64, help="completion tokens per request (default: %(default)s)")
    parser.add_argument("--reps", type=int, default=5, help="timed requests per cell (default: %(default)s)")
    parser.add_argument(
        "--temperatures", type=float_list, default=[1.0, 0.0], help="comma-separated temperatures (default: 1.0,0)"
    )
    parser.add_argument(
        "--prompt",
        action="append",
        help="a prompt to run; repeat for several (default: a code-completion prompt and a chat question)",
    )
    parser.add_argument(
        "--seed", type=int, default=1234, help="seed of the first rep when sampling (default: %(default)s)"
    )
    parser.add_argument("--top-k", type=int, default=20, help="top_k when sampling (default: %(default)s)")
    parser.add_argument("--top-p", type=float, default=0.95, help="top_p when sampling (default: %(default)s)")
    parser.add_argument("--thinking", action="store_true", help="turn the chat template's thinking on (default: off)")
    parser.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds per request (default: %(default)s)"
    )
    parser.add_argument("--json", action="store_true", help="print a JSON summary on the last line (default: off)")
    return parser.parse_args(argv)


def median_or_none(values: list[float | None]) -> float | None:
    """The median of the values that are known."""
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def show(value: float | None, scale: float, unit: str) -> str:
    """A number for the report, or n/a."""
    return "n/a" if value is None else f"{value * scale:.1f} {unit}"


def run_cell(
    args: argparse.Namespace, model: str, prompt: str, temperature: float
) -> list[tuple[int | None, StreamResult]]:
    """One warm-up request, then the timed reps of one (prompt, temperature) cell."""
    sampling = temperature > 0
    runs = []
    for rep in range(-1, args.reps):
        seed = args.seed + max(rep, 0) if sampling else None
        body = chat_body(model, prompt, args.tokens, temperature, seed, args.top_k, args.top_p, args.thinking)
        body["cache_salt"] = uuid.uuid4().hex  # its own: no rep resumes the prompt state an earlier one left cached
        result = stream_chat(args.base_url, body, args.api_key, args.timeout)
        if rep >= 0:
            runs.append((seed, result))
    return runs


def main(argv: list[str] | None = None) -> int:
    """Run every cell and print its medians and token hashes."""
    args = parse_args(argv)
    prompts = {f"prompt{i + 1}": p for i, p in enumerate(args.prompt)} if args.prompt else DEFAULT_PROMPTS
    try:
        model = args.model or resolve_model(args.base_url, args.api_key, args.timeout)
        cells: list[dict[str, Any]] = []
        short = 0
        for label, prompt in prompts.items():
            for temperature in args.temperatures:
                runs = run_cell(args, model, prompt, temperature)
                tok_s = median_or_none([r.decode_tok_s for _, r in runs])
                ttft = median_or_none([r.ttft for _, r in runs])
                print(
                    f"{label} T={temperature:g}: decode {show(tok_s, 1, 'tok/s')}, TTFT {show(ttft, 1e3, 'ms')}"
                    f" (median of {len(runs)})"
                )
                for rep, (seed, r) in enumerate(runs, 1):
                    print(
                        f"  rep {rep} seed {seed}: {show(r.decode_tok_s, 1, 'tok/s')}, TTFT {show(r.ttft, 1e3, 'ms')},"
                        f" {r.tokens} tokens, token_sha {r.token_sha}"
                    )
                    if r.is_short(args.tokens):
                        short += 1
                        print(f"  SHORT: rep {rep} ended after {r.tokens} of {args.tokens} tokens ({r.finish_reason})")
                cells.append(
                    {
                        "prompt": label,
                        "temperature": temperature,
                        "decode_tok_s_median": tok_s,
                        "ttft_s_median": ttft,
                        "reps": [
                            {
                                "seed": seed,
                                "decode_tok_s": r.decode_tok_s,
                                "ttft_s": r.ttft,
                                "tokens": r.tokens,
                                "finish_reason": r.finish_reason,
                                "token_sha": r.token_sha,
                            }
                            for seed, r in runs
                        ],
                    }
                )
    except StreamError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"base_url": args.base_url, "model": model, "tokens": args.tokens, "cells": cells}))
    if short:
        print(
            f"error: {short} reps ended before --tokens {args.tokens}: their figures are not of that length",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
