"""Guide mask cost over a vocabulary: how long a grammar state's first mask takes, and a cached one.

    python scripts/bench_masks.py --vocab 150000 [--tokenizer PATH] [--long {runs,words,cjk}]

Without --tokenizer the vocabulary is synthetic (seeded): the 256 single bytes, then random pieces of 2 to 12 bytes,
mostly lowercase letters with a leading space, some digits, punctuation and JSON's structural bytes, to a total of
--vocab ids. With --tokenizer the pieces are that checkpoint's tokens. Prints, for each grammar state below, the ms
of its first mask (a trie walk) and of a second (the cache), and how many ids it allows; then, along each long counted
repeat below, the masks of --steps successive states 4 bytes apart (an output that never revisits a state): their
total and slowest ms.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from server.grammar import Grammar
from server.grammar_ebnf import ebnf_grammar
from server.grammar_regex import regex_grammar
from server.grammar_schema import json_grammar
from server.token_masks import GuideMasks, TokenVocabulary

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {}}}}
JSON_EBNF = r"""
root ::= object
value ::= object | array | string | number | "true" | "false" | "null"
object ::= "{" ws (string ws ":" ws value ws ("," ws string ws ":" ws value ws)*)? "}"
array ::= "[" ws (value ws ("," ws value ws)*)? "]"
string ::= "\"" ([^"\\\x00-\x1f] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4}))* "\""
number ::= "-"? ("0" | [1-9] [0-9]*) ("." [0-9]+)? ([eE] [-+]? [0-9]+)?
ws ::= [ \t\n]{0,20}
"""  # any JSON object, as an EBNF grammar (recursive)
CASES = (  # (name, grammar, the output so far)
    ("json_object: start", json_grammar(None), b""),
    ("json_object: after '{'", json_grammar(None), b"{"),
    ("json_object: inside a key", json_grammar(None), b'{"ke'),
    ("json_object: inside a value string", json_grammar(None), b'{"key": "some te'),
    ("json_object: inside a number", json_grammar(None), b'{"key": 12'),
    ("schema: inside name", json_grammar(SCHEMA), b'{"name": "Al'),
    ("schema: inside tags", json_grammar(SCHEMA), b'{"name": "Al", "tags": [1, "x'),
    ("regex [a-z ,.]{1000}: after 10", regex_grammar("[a-z ,.]{1000}"), b"lighthouse"),
    ("ebnf json: inside a key", ebnf_grammar(JSON_EBNF), b'{"ke'),
    ("ebnf json: three deep, after ','", ebnf_grammar(JSON_EBNF), b'{"a": [[1, '),
    ("json_object: three deep, after ','", json_grammar(None), b'{"a": [[1, '),
)

RUNS = (  # (name, grammar, the output before the run)
    ("regex [a-z ,.]{1000}", regex_grammar("[a-z ,.]{1000}"), b""),
    ("schema: a string of maxLength 1000", json_grammar({"type": "string", "maxLength": 1000}), b'"'),
)
LONG_TOKENS = 784  # --long's tokens
RUN_TEXT = b"the keeper of the lighthouse, at dusk, lit the lamp. "


def synthetic_pieces(size: int, seed: int) -> list[bytes]:
    """The 256 single bytes, then distinct random pieces like a byte-level BPE's, to `size` ids."""
    rng = random.Random(seed)
    pieces, seen = [bytes([b]) for b in range(256)], set()
    alphabets = ("abcdefghijklmnopqrstuvwxyz",) * 6 + (
        "0123456789",
        ".,:;!?-_()[]{}\"'/\\",
        "ABCDEFGHIJKLMNOPQRSTUVWXYZ",
    )
    while len(pieces) < size:
        letters = rng.choice(alphabets)
        lead = " " if rng.random() < 0.5 else ""
        data = (lead + "".join(rng.choice(letters) for _ in range(rng.randint(2, 12)))).encode()
        if data not in seen:
            seen.add(data)
            pieces.append(data)
    return pieces


def long_pieces(kind: str, seed: int) -> list[bytes]:
    """LONG_TOKENS distinct pieces past 16 bytes: runs of one of seven bytes, 17 to 128 long; ASCII words of 17 to 40
    letters after a space; or words of 6 to 13 CJK characters (18 to 39 bytes)."""
    rng, pieces = random.Random(seed), set()
    if kind == "runs":
        return [bytes([byte]) * length for byte in b" -=_#*/" for length in range(17, 17 + LONG_TOKENS // 7)]
    while len(pieces) < LONG_TOKENS:
        if kind == "words":
            pieces.add((" " + "".join(rng.choice("abcdefghij") for _ in range(rng.randint(17, 40)))).encode())
        else:
            pieces.add("".join(chr(rng.randint(0x4E00, 0x4E40)) for _ in range(rng.randint(6, 13))).encode())
    return sorted(pieces)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=150_000, help="ids of the synthetic vocabulary (default 150000)")
    parser.add_argument("--tokenizer", type=Path, help="a checkpoint folder whose tokenizer gives the pieces")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=200, help="states timed along each run (default 200)")
    parser.add_argument(
        "--long", choices=("runs", "words", "cjk"), help="add 784 synthetic tokens past 16 bytes: runs of one byte "
        "(as tokenizers have for whitespace and rules), long ASCII words, or CJK words (UTF-8)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.tokenizer is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer))
        vocabulary = TokenVocabulary.from_tokenizer(tokenizer, len(tokenizer))
    else:
        pieces = synthetic_pieces(args.vocab - (LONG_TOKENS if args.long else 0), args.seed)
        pieces += long_pieces(args.long, args.seed) if args.long else []
        vocabulary = TokenVocabulary(pieces, args.vocab)
    print(f"vocabulary of {vocabulary.size} ids built in {(time.perf_counter() - start) * 1e3:.0f} ms")
    results = []
    for name, grammar, text in CASES:
        masks = GuideMasks(grammar, vocabulary, ())
        state = grammar.feed(grammar.initial, text)
        timings = []
        for _ in range(2):
            start = time.perf_counter()
            allowed = masks.allowed(state)
            timings.append((time.perf_counter() - start) * 1e3)
        results.append({"case": name, "first_ms": timings[0], "cached_ms": timings[1], "allowed": int(allowed.sum())})
        print(f"{name:40s} first {timings[0]:8.1f} ms, cached {timings[1]:6.3f} ms, {int(allowed.sum()):7d} ids")
    runs = [run_timings(name, grammar, text, vocabulary, args.steps) for name, grammar, text in RUNS]
    print(json.dumps(runs))
    print(json.dumps(results))
    return 0


def run_timings(name: str, grammar: Grammar, text: bytes, vocabulary: TokenVocabulary, steps: int) -> dict:
    """The masks of `steps` successive states along a run, 4 bytes apart: total and slowest ms."""
    masks = GuideMasks(grammar, vocabulary, ())
    state = grammar.feed(grammar.initial, text)
    output = (RUN_TEXT * (4 * steps // len(RUN_TEXT) + 1))[: 4 * steps]
    timings = []
    for step in range(steps):
        start = time.perf_counter()
        masks.allowed(state)
        timings.append((time.perf_counter() - start) * 1e3)
        state = grammar.feed(state, output[4 * step : 4 * step + 4])
    print(f"{name:40s} {steps} states: {sum(timings):8.1f} ms in all, slowest {max(timings):6.1f} ms")
    return {"run": name, "states": steps, "total_ms": sum(timings), "slowest_ms": max(timings)}


if __name__ == "__main__":
    sys.exit(main())
