"""Draft acceptance under penalties: six penalized greedy completions in turn, then the server's draft counts.

    python scripts/bench_draft_penalties.py --base-url http://127.0.0.1:8000

Run it against a fresh server: /health counts every request's drafts since the start. Each request asks for 64
tokens (ignore_eos) with repetition 1.3, frequency 0.5 and presence 0.3 penalties. Prints each output's token_sha
(drafts never change an output: compare them across trees), then the drafts proposed and accepted, in all and at
each position, as /health gives them; with --json, one JSON object of them last.
"""

from __future__ import annotations

import argparse
import json
import sys

import httpx
from openai_stream import DEFAULT_BASE_URL, DEFAULT_TIMEOUT

PROMPTS = (
    "def merge_sorted(left, right):\n    ",
    "class Stack:\n    def __init__(self):\n        ",
    "import os\n\ndef walk(path):\n    ",
    "Sort a list, please.",
    "def parse_args(argv):\n    ",
    "def fib(n):\n    ",
)
PENALTIES = {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.3}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=DEFAULT_BASE_URL)
    parser.add_argument("--json", action="store_true", help="print the counts as one JSON object last")
    args = parser.parse_args(argv)
    base = args.base_url.rstrip("/")
    shas = []
    for prompt in PROMPTS:
        body = {"prompt": prompt, "max_tokens": 64, "temperature": 0, "ignore_eos": True, **PENALTIES}
        reply = httpx.post(f"{base}/v1/completions", json=body, timeout=DEFAULT_TIMEOUT)
        reply.raise_for_status()
        shas.append(reply.json()["token_sha"])
        print(f"token_sha {shas[-1]} for {prompt!r}", flush=True)
    health = httpx.get(f"{base}/health", timeout=DEFAULT_TIMEOUT).json()
    counts = {key: health[key] for key in ("draft_tokens", "accepted_draft_tokens", "draft_acceptance")}
    counts["draft_acceptance_per_position"] = health["draft_acceptance_per_position"]
    print(f"drafts proposed {counts['draft_tokens']}, accepted {counts['accepted_draft_tokens']} "
          f"({counts['draft_acceptance']}); by position {counts['draft_acceptance_per_position']}")  # fmt: skip
    if args.json:
        print(json.dumps({**counts, "token_sha": shas}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
