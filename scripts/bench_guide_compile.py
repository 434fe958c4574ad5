"""What a large schema's compile costs the other streams: the longest gap between a streamed completion's chunks
while another request brings a schema that has never been compiled (nine strings of up to 1,000 characters, a large
network to compile), against the longest gap over the same span of a stream alone.

    python scripts/bench_guide_compile.py --base-url http://127.0.0.1:8000 [--tokens 1024] [--reps 3]

The stream must outlast the guided request (each line says whether it did): give it enough --tokens.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import threading
import time

import httpx
from openai_stream import open_client


def stream_times(base: str, tokens: int, started: threading.Event, times: list[float]) -> None:
    """Append the perf_counter time of each of a streamed completion's chunks that carry tokens (the first sets
    `started`; the token-less opening chunk comes before the stream's wait for its first token)."""
    body = {"prompt": "Once upon a time", "max_tokens": tokens, "ignore_eos": True, "stream": True, "temperature": 0,
            "return_token_ids": True}  # fmt: skip
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if line.startswith("data: {") and any(c.get("token_ids") for c in json.loads(line[6:]).get("choices", [])):
                times.append(time.perf_counter())
                started.set()


def big_schema(salt: int) -> dict:
    """Nine strings of up to 1,000 characters; `salt` makes each schema new to the server's compile cache."""
    properties = {f"field_{salt}_{index}": {"type": "string", "maxLength": 1000} for index in range(9)}
    return {"type": "object", "properties": properties}


def longest_gap(times: list[float], begin: float, end: float) -> float:
    """The longest time without a chunk within [begin, end], in seconds."""
    marks = [begin, *(moment for moment in times if begin < moment < end), max(begin, min(end, times[-1]))]
    return max(later - earlier for earlier, later in itertools.pairwise(marks))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens of the measured stream (default 1024)")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    salt = time.time_ns()
    results = []
    client = open_client(600)  # made before any clock starts: making one loads TLS certificates
    for rep in range(args.reps):
        span = None
        for mode in ("beside a compile", "alone"):
            started, times = threading.Event(), []
            streamer = threading.Thread(target=stream_times, args=(args.base_url, args.tokens, started, times))
            streamer.start()
            started.wait(600)
            time.sleep(0.2)
            begin = time.perf_counter()
            if mode == "alone":
                time.sleep(span)
            else:
                body = {"prompt": "A record:", "max_tokens": 1, "guided_json": big_schema(salt + rep)}
                client.post(f"{args.base_url}/v1/completions", json=body).raise_for_status()
                span = time.perf_counter() - begin
            end = begin + span
            streamer.join()
            result = {"rep": rep, "mode": mode, "span_s": span, "longest_gap_ms": longest_gap(times, begin, end) * 1e3,
                      "stream_outlasted": times[-1] > end}  # fmt: skip
            results.append(result)
            short = "" if result["stream_outlasted"] else " (the stream ended first: give more --tokens)"
            print(f"rep {rep} {mode:17} over {span:5.2f} s: longest gap {result['longest_gap_ms']:8.1f} ms{short}")
    client.close()
    print(json.dumps(results))
    ended_first = sum(not result["stream_outlasted"] for result in results)
    if ended_first:
        print(f"error: {ended_first} streams ended before their window: their gaps are not measured", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
