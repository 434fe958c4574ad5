"""Prompt-cache check: a first request, repeats of it, then concurrent streams of it; time to first token for each.

    python scripts/bench_cache.py --prompt-file long.txt --repeats 3 --streams 4 --require-cold --require-reuse
    python scripts/bench_cache.py --random-prompt 32768 --extend 64 --repeats 1 --streams 0 --tokens 1

With --extend N the repeats and streams send the first prompt followed by N more tokens (a next turn resuming it).

Exits 0 only if every request succeeded and the --require-* conditions hold (the run qualifies).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path

import httpx
from openai_stream import open_client


def carries_tokens(event: dict) -> bool:
    """Whether an SSE chunk carries generated tokens (the stream opens with an empty chunk, which does not)."""
    return any(choice.get("token_ids") for choice in event.get("choices") or [])


def one(client: httpx.Client, base_url: str, body: dict, api_key: str | None) -> dict:
    """Stream one completion on `client` (made before the clock starts: making one loads TLS certificates); its time
    to first token, cached tokens and token_sha."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    start, first, usage, sha = time.monotonic(), None, None, None
    with client.stream("POST", f"{base_url}/v1/completions", json=body, headers=headers) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read()[:300]!r}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            if first is None and carries_tokens(event):
                first = time.monotonic()
            usage = event.get("usage") or usage
            sha = event.get("token_sha") or sha
    end = time.monotonic()
    if usage is None or first is None:
        raise RuntimeError("the stream ended without tokens or usage")
    return {
        "ttft_ms": round((first - start) * 1000, 1),
        "total_ms": round((end - start) * 1000, 1),
        "completion_tokens": usage["completion_tokens"],
        "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
        "prompt_tokens": usage["prompt_tokens"],
        "token_sha": sha,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server (default http://127.0.0.1:8000)")
    parser.add_argument("--api-key", default=None, help="bearer key (default none)")
    parser.add_argument(
        "--prompt",
        default="The quick brown fox jumps over the lazy dog. " * 40,
        help="prompt text (default: a repeated sentence)",
    )
    parser.add_argument("--prompt-file", type=Path, default=None, help="read the prompt from a file (default none)")
    parser.add_argument("--prompt-ids", default=None, help="the prompt as comma-separated token ids (default none)")
    parser.add_argument(
        "--random-prompt", type=int, default=None, help="a prompt of this many seeded random token ids (default none)"
    )
    parser.add_argument("--vocab", type=int, default=4096, help="random ids are below this (default 4096)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random ids (default 0)")
    parser.add_argument(
        "--extend", type=int, default=0, help="repeats and streams add this many random ids (default 0)"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results here (default none)")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per request (default 16)")
    parser.add_argument("--repeats", type=int, default=2, help="identical requests after the first (default 2)")
    parser.add_argument("--streams", type=int, default=4, help="concurrent identical requests at the end (default 4)")
    parser.add_argument("--require-cold", action="store_true", help="the first request must report 0 cached tokens")
    parser.add_argument("--require-reuse", action="store_true", help="every repeat must report cached tokens > 0")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per request (default 600)")
    args = parser.parse_args(argv)
    draw = random.Random(args.seed)
    if args.random_prompt:
        prompt: str | list[int] = [draw.randrange(args.vocab) for _ in range(args.random_prompt)]
    elif args.prompt_ids:
        prompt = [int(t) for t in args.prompt_ids.split(",")]
    else:
        prompt = args.prompt_file.read_text() if args.prompt_file else args.prompt
    if args.extend and not isinstance(prompt, list):
        parser.error("--extend needs a token-id prompt (--prompt-ids or --random-prompt)")
    first_body = {
        "prompt": prompt,
        "max_tokens": args.tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    extended = [*prompt, *(draw.randrange(args.vocab) for _ in range(args.extend))] if args.extend else prompt
    body = first_body | {"prompt": extended}
    clients = [open_client(args.timeout) for _ in range(max(args.streams, 1))]  # one a concurrent stream
    try:
        first = one(clients[0], args.base_url, first_body, args.api_key)
        repeats = [one(clients[0], args.base_url, body, args.api_key) for _ in range(args.repeats)]
        results: list[dict] = [{}] * args.streams
        barrier = threading.Barrier(args.streams) if args.streams else None

        def stream(i: int) -> None:
            barrier.wait()
            results[i] = one(clients[i], args.base_url, body, args.api_key)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(args.streams)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    except (RuntimeError, httpx.HTTPError) as exc:
        print(f"FAILED: {exc}")
        return 2
    finally:
        for client in clients:
            client.close()
    print(f"first:   TTFT {first['ttft_ms']} ms, cached {first['cached_tokens']}/{first['prompt_tokens']}")
    for i, r in enumerate(repeats, 1):
        print(f"repeat {i}: TTFT {r['ttft_ms']} ms, cached {r['cached_tokens']}/{r['prompt_tokens']}")
    for i, r in enumerate(results):
        print(f"stream {i}: TTFT {r.get('ttft_ms')} ms, cached {r.get('cached_tokens')}/{r.get('prompt_tokens')}")
    reference = repeats[0] if args.extend and repeats else first
    same = all(r.get("token_sha") == reference["token_sha"] for r in [*repeats, *results])
    print(f"every token_sha equals the {'first repeat' if reference is not first else 'first request'}'s: {same}")
    if args.json:
        args.json.write_text(json.dumps({"first": first, "repeats": repeats, "streams": results}, indent=2) + "\n")
    ok = same and len([r for r in results if r]) == args.streams
    if args.require_cold and first["cached_tokens"] != 0:
        print("--require-cold: the first request reported cached tokens")
        ok = False
    if args.require_reuse and not all(r["cached_tokens"] > 0 for r in repeats):
        print("--require-reuse: a repeat reported no cached tokens")
        ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
