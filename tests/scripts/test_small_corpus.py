"""Tests for scripts/small_corpus.py on a small synthetic source folder: splits, bins, manifest and tokenizer."""

from __future__ import annotations

import contextlib
import hashlib
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import small_corpus
from tokenizers import Tokenizer
from transformers import AutoTokenizer

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "small_corpus.py"
NAMES = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet")
MODULE = '''"""Helpers for the {name} widgets."""

import math


def frob_{name}(count: int, scale: float = 1.5) -> float:
    """Return the frobnication of the {name} widgets.

    Scales the square root of the count of {name} widgets.
    """
    return math.sqrt(count) * scale + {i}


class Gadget{i}:
    """A gadget that holds the {name} widgets."""

    def spin(self, turns: int) -> int:
        """Spin the {name} gadget for the given number of turns."""
        return turns * {i}
'''
SPIN_BODY = '    """Spin the charlie gadget for the given number of turns."""\n    return turns * 2\n'
TEST_MODULE = '''def test_widgets():
    """Check that the widgets of the test folder are counted."""
    assert sum(range(4)) == 6
'''


def rel_path(i: int, name: str) -> str:
    """Where the synthetic module for name lives: half at the top, half in a package."""
    return f"{name}.py" if i < 5 else f"pkg/{name}.py"


def module_path(rel: str) -> str:
    """The dotted module name of a synthetic relative path."""
    return rel.removesuffix(".py").replace("/", ".")


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of modules with docstrings, an empty package init, a test folder and a file that is not UTF-8."""
    root = tmp_path_factory.mktemp("src")
    (root / "pkg").mkdir()
    (root / "pkg" / "__init__.py").write_text("")
    for i, name in enumerate(NAMES):
        (root / rel_path(i, name)).write_text(MODULE.format(name=name, i=i))
    (root / "tests").mkdir()
    (root / "tests" / "test_widgets.py").write_text(TEST_MODULE)
    (root / "latin.py").write_bytes(b"# caf\xe9 is not UTF-8\nx = 1\n" * 3)
    return root


def run_args(source: Path) -> list[str]:
    """Arguments for one build into ./data from source."""
    return ["data", "--vocab", "300", "--source", str(source), "--heldout-percent", "30"]


@pytest.fixture(scope="module")
def built(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One corpus build, in-process, shared by the module's tests."""
    cwd = tmp_path_factory.mktemp("run_a")
    with contextlib.chdir(cwd):
        small_corpus.main(run_args(source))
    return cwd / "data"


def manifest(out: Path) -> dict:
    """The build's manifest."""
    return json.loads((out / "manifest.json").read_text(encoding="utf-8"))


def decoded(out: Path, split: str) -> list[str]:
    """The split's documents: its bin cut at every eos, each piece decoded with its special tokens."""
    tok = Tokenizer.from_file(str(out / "tokenizer" / "tokenizer.json"))
    ids = np.fromfile(out / f"{split}.bin", dtype="<u2").tolist()
    eos = manifest(out)["eos_token_id"]
    assert not ids or ids[-1] == eos
    pieces: list[list[int]] = [[]]
    for idx in ids:
        pieces[-1].append(idx) if idx != eos else pieces.append([])
    return [tok.decode(p, skip_special_tokens=False) for p in pieces[:-1]]


def heldout_names(out: Path) -> tuple[set[str], set[str]]:
    """Relative paths of the held-out and the train modules among the synthetic ones."""
    heldout = set(manifest(out)["heldout_files"])
    rels = {rel_path(i, name) for i, name in enumerate(NAMES)}
    assert heldout & rels and rels - heldout, "the fixture needs both held-out and train modules"
    return heldout & rels, rels - heldout


def expected_chats(source: Path, rel: str, hf: object) -> list[str]:
    """The file's chat documents rendered by transformers: the thinking-off prompt, the answer, the turn end."""
    pairs = small_corpus.chat_pairs((source / rel).read_text(), module_path(rel))
    return [
        hf.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True, enable_thinking=False
        )
        + a
        + "<|im_end|>\n"
        for q, a in pairs
    ]


def test_heldout_code_is_never_in_train(built: Path, source: Path) -> None:
    """Held-out files' text lands in eval_code only; train files' text in train only; oddities are skipped."""
    heldout, train = heldout_names(built)
    train_text, eval_text = "".join(decoded(built, "train")), "".join(decoded(built, "eval_code"))
    for rel in heldout:
        assert (source / rel).read_text() in decoded(built, "eval_code")
        assert f"the {Path(rel).stem} widgets" not in train_text
    for rel in train:
        assert (source / rel).read_text() in decoded(built, "train")
        assert f"the {Path(rel).stem} widgets" not in eval_text
    files = manifest(built)["files"]
    assert files["train"] + files["heldout"] == len(NAMES) + 1  # the test module; not the empty init nor latin.py
    assert "caf" not in train_text + eval_text


def test_heldout_chats_land_in_eval_chat_only(built: Path) -> None:
    """A held-out module's questions appear in eval_chat and nowhere in train; the test folder gets no chats."""
    heldout, train = heldout_names(built)
    train_chats, eval_chats = decoded(built, "train"), decoded(built, "eval_chat")
    for rel in heldout:
        name = module_path(rel)
        assert any(f"`{name}.frob_" in d for d in eval_chats)
        assert not any(f"`{name}." in d for d in train_chats)
    for rel in train:
        assert any(f"`{module_path(rel)}.Gadget" in d for d in train_chats)
    assert not any("Check that the widgets" in d and "<|im_start|>" in d for d in train_chats + eval_chats)


def test_bins_decode_to_the_rendered_documents(built: Path, source: Path) -> None:
    """Each split decodes to exactly its code files and its chats as transformers renders them, eos after each."""
    heldout, train = heldout_names(built)
    hf = AutoTokenizer.from_pretrained(built / "tokenizer")
    train_docs = [(source / rel).read_text() for rel in [*train, "tests/test_widgets.py"]]
    train_docs += [chat for rel in train for chat in expected_chats(source, rel, hf)]
    assert Counter(decoded(built, "train")) == Counter(train_docs)
    assert Counter(decoded(built, "eval_code")) == Counter((source / rel).read_text() for rel in heldout)
    eval_chats = [chat for rel in heldout for chat in expected_chats(source, rel, hf)]
    assert Counter(decoded(built, "eval_chat")) == Counter(eval_chats)


def test_chat_documents_hold_the_assistant_answer(built: Path) -> None:
    """Chats end with the assistant turn: the docstring, or the function's source in a python fence."""
    docs = decoded(built, "train") + decoded(built, "eval_chat")
    turn = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    what = next(d for d in docs if "`alpha.frob_alpha`" in d)
    assert what.endswith(
        turn + "Return the frobnication of the alpha widgets.\n\n"
        "Scales the square root of the count of alpha widgets.<|im_end|>\n"
    )
    alpha = MODULE.format(name="alpha", i=0)
    function = alpha[alpha.index("def frob_alpha") : alpha.index("\n\n\nclass")]
    write = next(d for d in docs if "`frob_alpha(count: int, scale: float=1.5)`" in d)
    assert "Return the frobnication of the alpha widgets." in write.split(turn)[0]
    assert write.endswith(turn + f"```python\n{function}\n```<|im_end|>\n")
    method = next(d for d in docs if "`Gadget2.spin(self, turns: int)`" in d)
    assert method.endswith(turn + "```python\ndef spin(self, turns: int) -> int:\n" + SPIN_BODY + "```<|im_end|>\n")


def test_manifest_matches_the_bins(built: Path) -> None:
    """Documents, tokens, bytes and sha256 in the manifest match each bin; special ids sit at the vocab's end."""
    info = manifest(built)
    assert info["vocab_size"] == 300 and info["eos_token_id"] == info["special_token_ids"]["<|endoftext|>"] == 295
    assert list(info["special_token_ids"].values()) == list(range(295, 300))
    for split in small_corpus.SPLITS:
        data = (built / f"{split}.bin").read_bytes()
        stats = info["splits"][split]
        assert stats["sha256"] == hashlib.sha256(data).hexdigest()
        assert stats["bytes"] == len(data) == 2 * stats["tokens"] == 2 * (stats["code_tokens"] + stats["chat_tokens"])
        assert stats["documents"] == len(decoded(built, split)) == stats["code_documents"] + stats["chat_documents"]
    assert info["splits"]["eval_code"]["chat_documents"] == info["splits"]["eval_chat"]["code_documents"] == 0
    assert info["command"].startswith("python scripts/small_corpus.py data --vocab 300")


def test_two_runs_are_byte_identical(built: Path, source: Path, tmp_path: Path) -> None:
    """The command line in a fresh process, from the same sources, writes the very same bytes."""
    subprocess.run([sys.executable, str(SCRIPT), *run_args(source)], cwd=tmp_path, check=True, capture_output=True)
    again = tmp_path / "data"
    names = sorted(p.relative_to(built) for p in built.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    for name in names:
        assert (built / name).read_bytes() == (again / name).read_bytes(), name


def test_tokenizer_loads_and_round_trips(built: Path) -> None:
    """AutoTokenizer loads the folder, round-trips text and keeps each special token a single id."""
    hf = AutoTokenizer.from_pretrained(built / "tokenizer")
    assert len(hf) == 300 and hf.pad_token_id == 295
    for text in ["def f(x):\n    return x * 2  # héllo → ✓\n", "<|im_start|>user\nhi<|im_end|>\n", ""]:
        assert hf.decode(hf.encode(text)) == text
    assert [hf.encode(t) for t in small_corpus.SPECIAL_TOKENS] == [[i] for i in range(295, 300)]
