"""Guide mask cost over a vocabulary: how long a grammar state's first mask takes, and a cached one.

    python scripts/bench_masks.py --vocab 150000 [--tokenizer PATH]

Without --tokenizer the vocabulary is synthetic (seeded): the 256 single bytes, then random pieces of 2 to 12 bytes,
mostly lowercase letters with a leading space, some digits, punctuation and JSON's structural bytes, to a total of
--vocab ids. With --tokenizer the pieces are that checkpoint's tokens. Prints, for each grammar state below, the ms
of its first mask (a trie walk) and of a second (the cache), and how many ids it allows.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from server.grammar import json_grammar, regex_grammar
from server.token_masks import GuideMasks, TokenVocabulary

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {}}}}
CASES = (  # (name, grammar, the output so far)
    ("json_object: start", json_grammar(None), b""),
    ("json_object: after '{'", json_grammar(None), b"{"),
    ("json_object: inside a key", json_grammar(None), b'{"ke'),
    ("json_object: inside a value string", json_grammar(None), b'{"key": "some te'),
    ("json_object: inside a number", json_grammar(None), b'{"key": 12'),
    ("schema: inside name", json_grammar(SCHEMA), b'{"name": "Al'),
    ("schema: inside tags", json_grammar(SCHEMA), b'{"name": "Al", "tags": [1, "x'),
    ("regex [a-z ,.]{1000}: after 10", regex_grammar("[a-z ,.]{1000}"), b"lighthouse"),
)


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=150_000, help="ids of the synthetic vocabulary (default 150000)")
    parser.add_argument("--tokenizer", type=Path, help="a checkpoint folder whose tokenizer gives the pieces")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.tokenizer is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer))
        vocabulary = TokenVocabulary.from_tokenizer(tokenizer, len(tokenizer))
    else:
        vocabulary = TokenVocabulary(synthetic_pieces(args.vocab, args.seed), args.vocab)
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
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
