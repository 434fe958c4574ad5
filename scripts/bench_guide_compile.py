"""What a large schema's compile costs the other streams: the longest gap between a streamed completion's chunks
while another request brings a schema that has never been compiled (nine strings of up to 1,000 characters, about a
second to compile), against the longest gap of a stream alone.

    python scripts/bench_guide_compile.py --base-url http://127.0.0.1:8000 [--tokens 64] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import httpx


def stream_gaps(base: str, tokens: int, started: threading.Event) -> list[float]:
    """The seconds between a streamed completion's chunks (its first chunk sets `started`)."""
    body = {"prompt": "Once upon a time", "max_tokens": tokens, "ignore_eos": True, "stream": True, "temperature": 0}
    gaps, last = [], None
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
            started.set()
    return gaps


def big_schema(salt: int) -> dict:
    """Nine strings of up to 1,000 characters; `salt` makes each schema new to the server's compile cache."""
    properties = {f"field_{salt}_{index}": {"type": "string", "maxLength": 1000} for index in range(9)}
    return {"type": "object", "properties": properties}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--tokens", type=int, default=64, help="tokens of the measured stream (default 64)")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    salt = time.time_ns()
    results = []
    for rep in range(args.reps):
        for mode in ("alone", "beside a compile"):
            started = threading.Event()
            gaps: list[float] = []
            streamer = threading.Thread(
                target=lambda gaps=gaps, started=started: gaps.extend(stream_gaps(args.base_url, args.tokens, started))
            )
            streamer.start()
            compile_s = None
            if mode != "alone":
                started.wait(600)
                time.sleep(0.2)
                body = {"prompt": "A record:", "max_tokens": 1, "guided_json": big_schema(salt + rep)}
                begin = time.perf_counter()
                httpx.post(f"{args.base_url}/v1/completions", json=body, timeout=600).raise_for_status()
                compile_s = time.perf_counter() - begin
            streamer.join()
            gaps.sort()
            result = {"rep": rep, "mode": mode, "chunks": len(gaps) + 1, "longest_gap_ms": gaps[-1] * 1e3,
                      "median_gap_ms": gaps[len(gaps) // 2] * 1e3, "guided_request_s": compile_s}  # fmt: skip
            results.append(result)
            guided = f", guided request {compile_s:.2f} s" if compile_s else ""
            print(f"rep {rep} {mode:17} longest gap {result['longest_gap_ms']:8.1f} ms, median "
                  f"{result['median_gap_ms']:6.1f} ms{guided}")  # fmt: skip
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
