"""Build the small training corpus: Python sources and docstring chats, a byte-level BPE tokenizer, uint16 bins."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import hashlib
import json
import logging
import random
import re
import shlex
import sys
import sysconfig
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from jinja2 import Template
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tiny_tokenizer import NO_THINKING_TEMPLATE, SPECIAL_TOKENS, build_tokenizer
from tokenizers import Tokenizer

log = logging.getLogger(__name__)

STDLIB = Path(sysconfig.get_paths()["stdlib"])
# Installed packages, bundled apps and demos, generated tables and data blobs, Python 2 era sources.
SKIP_DIRS = frozenset(
    {"site-packages", "__pycache__", "idlelib", "turtledemo", "lib2to3", "pydoc_data", "encodings", "ensurepip"}
)
TEST_DIRS = frozenset({"test", "tests"})
FILE_CHAR_CAP = 200_000
ANSWER_CHAR_CAP = 4_000
MIN_DOC_CHARS = 32
EOS = "<|endoftext|>"
EMPTY_THINK = "<think>\n\n</think>\n\n"
SPLITS = ("train", "eval_code", "eval_chat")
SPECIALS_RE = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))
WHAT_QUESTIONS = ("What does `{name}` do?", "Explain what `{name}` does.", "What is `{name}` for in Python?")
WRITE_QUESTIONS = (
    "Write a Python function `{sig}` that does this: {summary}",
    "Implement `{sig}` in Python. It should do the following: {summary}",
    "Please write `{sig}`: {summary}",
)


@dataclasses.dataclass(frozen=True, slots=True)
class SourceFile:
    """One Python source: its path relative to its root (posix) and its text."""

    rel: str
    text: str


Definition = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef


@dataclasses.dataclass(frozen=True, slots=True)
class Document:
    """One training document: kind is 'code' or 'chat'."""

    kind: str
    text: str


def stable_bucket(key: str) -> int:
    """A stable bucket in [0, 100) for key, from its sha256."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "little") % 100


def pick(options: tuple[str, ...], key: str) -> str:
    """One of options, chosen stably by key."""
    return options[stable_bucket(key) % len(options)]


def source_files(root: Path) -> Iterator[SourceFile]:
    """The root's .py files in sorted order, skipping odd directories and files that are not UTF-8."""
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIP_DIRS.intersection(rel.parts[:-1]):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, ValueError):
            log.info("skipping %s: not UTF-8", rel)
            continue
        yield SourceFile(rel.as_posix(), text)


def module_name(rel: str) -> str:
    """The dotted module name of a relative .py path."""
    parts = rel.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts) or "__init__"


def has_special(text: str) -> bool:
    """Whether text spells a special token, which would encode as that token."""
    return SPECIALS_RE.search(text) is not None


def code_document(text: str) -> str | None:
    """The file's text cut to FILE_CHAR_CAP at a line end, or None when it is too short or spells a special."""
    if len(text) > FILE_CHAR_CAP:
        text = text[: text.rfind("\n", 0, FILE_CHAR_CAP) + 1]
    return None if len(text.strip()) < MIN_DOC_CHARS or has_special(text) else text


def definitions(body: list[ast.stmt], prefix: str = "") -> Iterator[tuple[str, Definition]]:
    """Names within the module and nodes of body's classes, functions and methods (not functions in functions)."""
    for node in body:
        if isinstance(node, Definition):
            yield prefix + node.name, node
        if isinstance(node, ast.ClassDef):
            yield from definitions(node.body, f"{prefix}{node.name}.")


def function_source(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """The function's dedented source, decorators included."""
    start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    return textwrap.dedent("".join(lines[start - 1 : node.end_lineno])).rstrip("\n")


def chat_pairs(text: str, module: str) -> Iterator[tuple[str, str]]:
    """Question and answer pairs from the docstrings of the module's classes and functions."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return
    lines = text.splitlines(keepends=True)
    for name, node in definitions(tree.body):
        doc = ast.get_docstring(node, clean=True)
        if not doc or not MIN_DOC_CHARS <= len(doc) <= ANSWER_CHAR_CAP:
            continue
        yield pick(WHAT_QUESTIONS, f"{module}.{name}").format(name=f"{module}.{name}"), doc
        if isinstance(node, ast.ClassDef):
            continue
        source = function_source(lines, node)
        if len(source) <= ANSWER_CHAR_CAP:
            question = pick(WRITE_QUESTIONS, f"{module}.{name}")
            summary = doc.split("\n", 1)[0]
            yield question.format(sig=f"{name}({ast.unparse(node.args)})", summary=summary), f"```python\n{source}\n```"


def chat_template() -> Template:
    """The chat template, compiled the way transformers compiles it."""

    def raise_exception(message: str) -> None:
        """The template's error hook."""
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals["raise_exception"] = raise_exception
    return env.from_string(NO_THINKING_TEMPLATE)


def render_chat(template: Template, question: str, answer: str) -> str:
    """The whole single-turn conversation; the answer follows the empty think block a thinking-off prompt ends in."""
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": EMPTY_THINK + answer}]
    return template.render(messages=messages, add_generation_prompt=False, enable_thinking=False)


def file_documents(source: SourceFile, template: Template) -> list[Document]:
    """The file's code document, then its chat documents (none from test directories)."""
    code = code_document(source.text)
    docs = [Document("code", code)] if code else []
    if TEST_DIRS.intersection(source.rel.split("/")[:-1]):
        return docs
    pairs = chat_pairs(source.text, module_name(source.rel))
    return docs + [Document("chat", render_chat(template, q, a)) for q, a in pairs if not has_special(q + a)]


def split_documents(
    sources: list[Path], heldout_percent: int
) -> tuple[dict[str, list[Document]], dict[str, list[str]]]:
    """Documents per split and relative file paths per split ('train' or 'heldout')."""
    template = chat_template()
    docs: dict[str, list[Document]] = {name: [] for name in SPLITS}
    files: dict[str, list[str]] = {"train": [], "heldout": []}
    for root in sources:
        for source in source_files(root):
            file_docs = file_documents(source, template)
            if not file_docs:
                continue
            heldout = stable_bucket(source.rel) < heldout_percent
            files["heldout" if heldout else "train"].append(source.rel)
            for doc in file_docs:
                docs[("eval_" + doc.kind) if heldout else "train"].append(doc)
    random.Random(0).shuffle(docs["train"])
    return docs, files


def tokenizer_texts(docs: list[Document]) -> Iterator[str]:
    """The documents' text between special tokens, which the BPE never learns to merge."""
    for doc in docs:
        yield from (piece for piece in SPECIALS_RE.split(doc.text) if piece)


def encode_split(tok: Tokenizer, docs: list[Document], eos_id: int) -> tuple[np.ndarray, dict[str, int]]:
    """The split's ids (each document then eos) as little-endian uint16, and token counts per kind."""
    encoded = tok.encode_batch([d.text for d in docs], add_special_tokens=False)
    counts = {"code_tokens": 0, "chat_tokens": 0}
    chunks: list[np.ndarray] = []
    for doc, enc in zip(docs, encoded, strict=True):
        chunks.append(np.asarray([*enc.ids, eos_id], dtype="<u2"))
        counts[f"{doc.kind}_tokens"] += len(enc.ids) + 1
    return (np.concatenate(chunks) if chunks else np.zeros(0, dtype="<u2")), counts


def split_stats(docs: list[Document], ids: np.ndarray, counts: dict[str, int], data: bytes) -> dict[str, object]:
    """One split's manifest entry."""
    return {
        "documents": len(docs),
        "code_documents": sum(d.kind == "code" for d in docs),
        "chat_documents": sum(d.kind == "chat" for d in docs),
        "chars": sum(len(d.text) for d in docs),
        "tokens": int(ids.size),
        **counts,
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }


def source_entry(root: Path) -> dict[str, str]:
    """A source root's manifest entry, with the licence when it is this Python's standard library."""
    stdlib = root.resolve() == STDLIB.resolve()
    return {"root": str(root), "python": sys.version.split()[0], "licence": "PSF-2.0" if stdlib else "unknown"}


def build_corpus(out: Path, vocab_size: int, sources: list[Path], heldout_percent: int, command: str) -> dict:
    """Write OUT/tokenizer/, the three bins and manifest.json; return the manifest."""
    if not 256 + len(SPECIAL_TOKENS) <= vocab_size <= 1 << 16:
        raise ValueError(f"--vocab must be in [{256 + len(SPECIAL_TOKENS)}, 65536] for uint16 ids, got {vocab_size}")
    if not 0 <= heldout_percent < 100:
        raise ValueError(f"--heldout-percent must be in [0, 100), got {heldout_percent}")
    for root in sources:
        if not root.is_dir():
            raise ValueError(f"--source {root} is not a directory")
    docs, files = split_documents(sources, heldout_percent)
    log.info("documents: %s", {name: len(d) for name, d in docs.items()})
    special_ids = build_tokenizer(out / "tokenizer", vocab_size, tokenizer_texts(docs["train"]), NO_THINKING_TEMPLATE)
    tok = Tokenizer.from_file(str(out / "tokenizer" / "tokenizer.json"))
    splits = {}
    for name in SPLITS:
        ids, counts = encode_split(tok, docs[name], special_ids[EOS])
        data = ids.tobytes()
        (out / f"{name}.bin").write_bytes(data)
        splits[name] = split_stats(docs[name], ids, counts, data)
    manifest = {
        "command": command,
        "sources": [source_entry(root) for root in sources],
        "files": {name: len(paths) for name, paths in files.items()},
        "heldout_files": files["heldout"],
        "splits": splits,
        "vocab_size": vocab_size,
        "dtype": "uint16 little-endian",
        "eos_token_id": special_ids[EOS],
        "special_token_ids": special_ids,
        "tokenizer_sha256": hashlib.sha256((out / "tokenizer" / "tokenizer.json").read_bytes()).hexdigest(),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest


def main(argv: list[str] | None = None) -> None:
    """Command line entry point: build the corpus into OUT."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path, help="output directory")
    parser.add_argument("--vocab", type=int, default=4096, help="total vocab size including special tokens")
    parser.add_argument("--source", type=Path, action="append", help="folder of .py files (default: the stdlib)")
    parser.add_argument("--heldout-percent", type=int, default=3, help="share of files held out for evaluation")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    start = time.perf_counter()
    command = shlex.join(["python", "scripts/small_corpus.py", *argv])
    manifest = build_corpus(args.out, args.vocab, args.source or [STDLIB], args.heldout_percent, command)
    summary = {name: {k: s[k] for k in ("documents", "chars", "tokens")} for name, s in manifest["splits"].items()}
    log.info("done in %.1f s: %s", time.perf_counter() - start, json.dumps(summary))


if __name__ == "__main__":
    main()
