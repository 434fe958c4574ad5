"""Tests for scripts/tiny_tokenizer.py: vocab layout, round trips, loading and the chat template."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from jinja2 import TemplateError
from tokenizers import Tokenizer
from transformers import AutoTokenizer

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "tiny_tokenizer.py"
SPECIAL_IDS = {"<|endoftext|>": 507, "<|im_start|>": 508, "<|im_end|>": 509, "<think>": 510, "</think>": 511}
CHAT = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi"}]
PREFIX = "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def load_script() -> ModuleType:
    """Import the script by path so the test does not touch sys.path."""
    spec = importlib.util.spec_from_file_location("tiny_tokenizer", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tiny_tokenizer = load_script()


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, int]]:
    """Build one vocab-512 tokenizer shared by the module's tests."""
    out = tmp_path_factory.mktemp("tok")
    return out, tiny_tokenizer.build_tokenizer(out, 512)


def test_vocab_size_and_special_ids(built: tuple[Path, dict[str, int]]) -> None:
    """The vocab has exactly 512 entries and the specials take the last ids in order."""
    out, ids = built
    assert ids == SPECIAL_IDS and list(ids) == list(SPECIAL_IDS)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    vocab = tok.get_vocab(with_added_tokens=True)
    assert len(vocab) == tok.get_vocab_size() == 512
    assert sorted(vocab.values()) == list(range(512))
    assert {t: vocab[t] for t in SPECIAL_IDS} == SPECIAL_IDS


@pytest.mark.parametrize(
    "text",
    ["héllo wörld → ✓", "def f(x: int) -> int:\n\treturn x ** 2  # 12345\n", "  spaces\r\n\n and 日本語 🙂 ", ""],
)
def test_round_trip(built: tuple[Path, dict[str, int]], text: str) -> None:
    """Encoding then decoding gives back the exact text, both raw and through transformers."""
    out, _ = built
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.decode(tok.encode(text).ids) == text
    hf = AutoTokenizer.from_pretrained(out)
    assert hf.decode(hf.encode(text)) == text


def test_special_tokens_are_single_ids(built: tuple[Path, dict[str, int]]) -> None:
    """Each special token encodes to its own single id, also inside running text."""
    out, _ = built
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    for text, idx in SPECIAL_IDS.items():
        assert tok.encode(text).ids == [idx]
    ids = tok.encode("<|im_start|>user\nhi<|im_end|><think>x</think>").ids
    assert ids[0] == 508 and 509 in ids and 510 in ids and 511 in ids


def test_auto_tokenizer_loads(built: tuple[Path, dict[str, int]]) -> None:
    """AutoTokenizer loads the folder with the configured special tokens and no BOS."""
    out, _ = built
    hf = AutoTokenizer.from_pretrained(out)
    assert len(hf) == 512
    assert (hf.eos_token, hf.eos_token_id, hf.pad_token, hf.pad_token_id) == ("<|im_end|>", 509, "<|endoftext|>", 507)
    assert hf.bos_token is None and hf.model_max_length == tiny_tokenizer.MODEL_MAX_LENGTH
    assert hf.encode("hi") == Tokenizer.from_file(str(out / "tokenizer.json")).encode("hi").ids
    config = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["chat_template"] == (out / "chat_template.jinja").read_text(encoding="utf-8")


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, PREFIX + "<think>\n"),
        ({"enable_thinking": False}, PREFIX + "<think>\n\n</think>\n\n"),
        ({"reasoning_effort": "low"}, PREFIX.replace("helpful.", "helpful.\nReasoning effort: low.") + "<think>\n"),
    ],
)
def test_chat_template(built: tuple[Path, dict[str, int]], kwargs: dict[str, object], expected: str) -> None:
    """The chat template renders the exact ChatML prompt for thinking on, off and a reasoning effort."""
    hf = AutoTokenizer.from_pretrained(built[0])
    assert hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True, **kwargs) == expected


def test_chat_template_history_and_effort_without_system(built: tuple[Path, dict[str, int]]) -> None:
    """Earlier assistant turns lose their thinking; an effort without a system message becomes its own."""
    hf = AutoTokenizer.from_pretrained(built[0])
    chat = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nA"},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "<think>\nok\n</think>\n\nB"},
    ]
    assert hf.apply_chat_template(chat, tokenize=False, reasoning_effort="xhigh") == (
        "<|im_start|>system\nReasoning effort: xhigh.<|im_end|>\n<|im_start|>user\na<|im_end|>\n"
        "<|im_start|>assistant\nA<|im_end|>\n<|im_start|>user\nb<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nok\n</think>\n\nB<|im_end|>\n"
    )
    with pytest.raises(TemplateError, match="reasoning_effort"):
        hf.apply_chat_template(chat, tokenize=False, reasoning_effort="max")


TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
TOOLS_SECTION = (
    "# Tools\n\nThese functions may be called, one JSON signature a line:\n<tools>\n" + json.dumps(TOOL) + "\n</tools>"
    "\n\nTo call one, write its name and arguments as one JSON object between <tool_call> and </tool_call>:\n"
    '<tool_call>\n{"name": <function name>, "arguments": <arguments object>}\n</tool_call>'
)


@pytest.mark.parametrize(
    ("system", "effort", "opening"),
    [
        (None, None, f"<|im_start|>system\n{TOOLS_SECTION}<|im_end|>\n"),
        (None, "low", f"<|im_start|>system\nReasoning effort: low.\n\n{TOOLS_SECTION}<|im_end|>\n"),
        ("Be brief.", "low", f"<|im_start|>system\nBe brief.\nReasoning effort: low.\n\n{TOOLS_SECTION}<|im_end|>\n"),
    ],
)
def test_chat_template_offers_tools_in_the_system_turn(built, system, effort, opening) -> None:
    """Offered tools are listed, one JSON signature a line, after the system text and the effort."""
    hf = AutoTokenizer.from_pretrained(built[0])
    chat = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": "1+2?"}]
    kwargs = {} if effort is None else {"reasoning_effort": effort}
    rendered = hf.apply_chat_template(chat, tools=[TOOL], tokenize=False, **kwargs)
    assert rendered == opening + "<|im_start|>user\n1+2?<|im_end|>\n"
    assert hf.apply_chat_template(chat, tokenize=False, **kwargs) == hf.apply_chat_template(
        chat, tools=[], tokenize=False, **kwargs
    )


def test_chat_template_renders_calls_and_groups_tool_responses_in_one_user_turn(built) -> None:
    hf = AutoTokenizer.from_pretrained(built[0])
    calls = [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}},
             {"type": "function", "function": {"name": "add", "arguments": {}}}]  # fmt: skip
    chat = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "Adding.", "tool_calls": calls},
        {"role": "tool", "content": "3"},
        {"role": "tool", "content": "0"},
        {"role": "user", "content": "thanks"},
    ]
    assert hf.apply_chat_template(chat, tokenize=False) == (
        "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\nAdding.\n"
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\n0\n</tool_response><|im_end|>\n"
        "<|im_start|>user\nthanks<|im_end|>\n"
    )


def test_the_shipped_checkpoint_carries_this_scripts_template() -> None:
    """The shipped model's template is NO_THINKING_TEMPLATE, in both files transformers reads it from."""
    shipped = SCRIPT.parents[1] / "model" / "checkpoints" / "flashnext-small"
    assert (shipped / "chat_template.jinja").read_text(encoding="utf-8") == tiny_tokenizer.NO_THINKING_TEMPLATE
    config = json.loads((shipped / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["chat_template"] == tiny_tokenizer.NO_THINKING_TEMPLATE


def test_deterministic_across_builds_and_cli(tmp_path: Path) -> None:
    """Building in-process and again through the CLI in a new process gives identical tokenizer.json bytes."""
    assert tiny_tokenizer.build_tokenizer(tmp_path / "a", 512) == SPECIAL_IDS
    assert tiny_tokenizer.build_tokenizer(tmp_path / "b", 512) == SPECIAL_IDS
    run = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path / "c"), "--vocab-size", "512"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(run.stdout) == SPECIAL_IDS
    first = (tmp_path / "a" / "tokenizer.json").read_bytes()
    assert first == (tmp_path / "b" / "tokenizer.json").read_bytes() == (tmp_path / "c" / "tokenizer.json").read_bytes()


def test_rejects_too_small_or_too_large_vocab(tmp_path: Path) -> None:
    """Vocab sizes below the byte alphabet plus specials, or beyond what the corpus supports, raise."""
    with pytest.raises(ValueError, match="at least 261"):
        tiny_tokenizer.build_tokenizer(tmp_path, 260)
    with pytest.raises(ValueError, match="corpus only supports"):
        tiny_tokenizer.build_tokenizer(tmp_path, 1_000_000)
