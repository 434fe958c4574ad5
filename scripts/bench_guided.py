"""Guided decoding benchmark: what a grammar costs a served request, against the same requests unguided.

    python scripts/bench_guided.py --requests 32 --tokens 128 --concurrency 1 8 --passes 2 [--no-drafts] \
        [--guide {regex,json,grammar}]

Each request asks for exactly `--tokens` tokens of one prompt (seeded, sampled, its own seed): `plain` without a guide
(ignore_eos), `guided` under `--guide`: `guided_regex` `[a-z ,.]{1000}` (the default), `guided_json` of a list of at
least 100 records of three keys, or `guided_grammar` of an EBNF list of at least 100 items, each a word, a number or a
nested list; none completes inside `--tokens` tokens, so each runs to its length. Each mode runs
once at each concurrency to warm up, then the timed passes run the modes in turn. Prints one line per pass, mode and
concurrency (output tokens a second over the run, the mean request latency, the drafts the server verified and kept
meanwhile) and, with --json, a JSON list of them last. Every answer is checked to hold `--tokens` tokens, and every
guided answer's text to be a prefix its grammar takes. With --no-drafts every request sends `"draft": false` (a guided
lane's MTP drafts are not guided: they are cut at the first one its grammar refuses and filled with the text the
grammar forces, so with drafts the two modes also differ in what the drafts keep).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import httpx
from openai_stream import DEFAULT_BASE_URL, DEFAULT_TIMEOUT, open_client, resolve_model

from server.grammar import Grammar
from server.grammar_ebnf import ebnf_grammar
from server.grammar_regex import regex_grammar
from server.grammar_schema import json_grammar

PATTERN = "[a-z ,.]{1000}"
RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "size": {"enum": ["S", "M", "L"]},
        "count": {"type": "integer"},
    },
    "required": ["name", "size", "count"],
}
SCHEMA = {"type": "array", "items": RECORD, "minItems": 100}
GRAMMAR = 'root ::= "[" item (", " item){99,} "]"\nitem ::= [a-z]{1,12} | [0-9]{1,6} | "[" item (", " item)* "]"'
PROMPT = "Write a short story about a lighthouse keeper.\n\n"


GUIDES: dict[str, Callable[[], tuple[dict, Grammar]]] = {  # each guide's request field, and a grammar of its prefixes
    "regex": lambda: ({"guided_regex": PATTERN}, regex_grammar("[a-z ,.]*")),
    "json": lambda: ({"guided_json": SCHEMA}, json_grammar(SCHEMA)),
    "grammar": lambda: ({"guided_grammar": GRAMMAR}, ebnf_grammar(GRAMMAR)),
}


@dataclass(frozen=True, slots=True)
class ModeResult:
    """One mode's run at one concurrency: output tokens a second over the run, and each request's mean latency."""

    mode: str
    run: int
    requests: int
    tokens: int
    concurrency: int
    wall_s: float
    output_tok_s: float
    mean_latency_s: float
    draft_tokens: int  # drafts the server verified during the run (/health's count before and after it)
    accepted_draft_tokens: int


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=DEFAULT_BASE_URL)
    parser.add_argument("--requests", type=int, default=8, help="requests a mode sends (default 8)")
    parser.add_argument("--tokens", type=int, default=128, help="tokens each request asks for (default 128)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8], help="requests in flight (default 1 8)")
    parser.add_argument("--passes", type=int, default=2, help="timed passes over the modes (default 2)")
    parser.add_argument("--no-drafts", action="store_true", help='send "draft": false in every request')
    parser.add_argument("--guide", choices=GUIDES, default="regex", help="the guided mode's grammar")
    parser.add_argument("--json", action="store_true", help="print the results as a JSON list last")
    args = parser.parse_args(argv)
    for name in ("requests", "tokens", "passes"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}: must be at least 1")
    if min(args.concurrency) < 1:
        parser.error("--concurrency: each must be at least 1")
    return args


def run_mode(args: argparse.Namespace, model: str, mode: str, concurrency: int, run: int) -> ModeResult:
    """Send `args.requests` requests, `concurrency` at a time, each for `args.tokens` tokens, guided or not."""
    guided, grammar = GUIDES[args.guide]()
    guide = guided if mode == "guided" else {"ignore_eos": True}
    guide |= {"draft": False} if args.no_drafts else {}
    url = f"{args.base_url.rstrip('/')}/v1/completions"

    def one(index: int) -> float:
        body = {"model": model, "prompt": PROMPT, "max_tokens": args.tokens, "temperature": 0.8, "seed": index,
                "return_token_ids": True, **guide}  # fmt: skip
        start = time.perf_counter()
        reply = client.post(url, json=body)
        reply.raise_for_status()
        choice = reply.json()["choices"][0]
        if len(choice["token_ids"]) != args.tokens:
            raise RuntimeError(f"{mode}: {len(choice['token_ids'])} tokens, not {args.tokens}")
        if mode == "guided" and grammar.feed(grammar.initial, choice["text"].encode()) is None:
            raise RuntimeError(f"guided text left the grammar: {choice['text'][:80]!r}")
        return time.perf_counter() - start

    before = drafts(args.base_url)
    with open_client(DEFAULT_TIMEOUT, concurrency) as client, ThreadPoolExecutor(concurrency) as pool:
        start = time.perf_counter()  # the client made before: making one loads TLS certificates
        latencies = list(pool.map(one, range(args.requests)))
        wall = time.perf_counter() - start
    after = drafts(args.base_url)
    total = args.requests * args.tokens
    mean_latency = sum(latencies) / len(latencies)
    drafted, accepted = (late - early for late, early in zip(after, before, strict=True))
    return ModeResult(
        mode, run, args.requests, args.tokens, concurrency, wall, total / wall, mean_latency, drafted, accepted
    )


def drafts(base_url: str) -> tuple[int, int]:
    """The server's drafts verified and accepted so far (/health)."""
    health = httpx.get(f"{base_url.rstrip('/')}/health", timeout=DEFAULT_TIMEOUT).json()
    return health["draft_tokens"], health["accepted_draft_tokens"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = resolve_model(args.base_url)
    results = []
    for run in range(args.passes + 1):  # run 0 warms up: the grammar's masks, each batch size's first rounds
        for concurrency in args.concurrency:
            for mode in ("plain", "guided"):
                result = run_mode(args, model, mode, concurrency, run)
                if run == 0:
                    continue
                results.append(result)
                kept = f"{result.accepted_draft_tokens} of {result.draft_tokens} drafts kept"
                print(f"pass {run} {mode:7s} concurrency {concurrency:3d}: {result.output_tok_s:8.1f} output tok/s, "
                      f"mean latency {result.mean_latency_s:6.3f} s over {result.wall_s:.2f} s, {kept}")  # fmt: skip
    if args.json:
        print(json.dumps([asdict(r) for r in results]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
