"""Build the small byte-level BPE tokenizer used by the tiny Flash Next checkpoints."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import difflib
import inspect
import json
import textwrap
import typing
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
MODEL_MAX_LENGTH = 32768
FILE_CHAR_CAP = 150_000
CORPUS_CHAR_CAP = 800_000  # ~0.3 s of training; supports vocab sizes up to roughly 12k
CORPUS_MODULES = (argparse, collections, dataclasses, difflib, inspect, json, textwrap, typing)
SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "Flash Next is a mixture-of-experts language model served at tensor parallel two.",
    "Please think step by step, then give a short and clear answer.",
    "Tokenizers split text into pieces; the model predicts the next piece.",
    "How many r's are in the word strawberry? There are three.",
)
# Digits alone, letter runs with one leading non-letter, punctuation runs, newline runs, other spaces.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHAT_TEMPLATE = """\
{%- set effort = reasoning_effort | default(none) -%}
{%- if effort is not none and effort not in ['low', 'medium', 'high', 'xhigh'] -%}
{{- raise_exception('reasoning_effort must be one of low, medium, high, xhigh') -}}
{%- endif -%}
{%- set ns = namespace(last_user=-1, tools='') -%}
{%- for m in messages -%}
{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- for tool in tools or [] -%}
{%- set ns.tools = ns.tools ~ '\\n' ~ (tool | tojson) -%}
{%- endfor -%}
{%- if ns.tools -%}
{%- set ns.tools = '# Tools\\n\\nThese functions may be called, one JSON signature a line:\\n<tools>' ~ ns.tools
    ~ '\\n</tools>\\n\\nTo call one, write its name and arguments as one JSON object between <tool_call> and '
    ~ '</tool_call>:\\n'
    ~ '<tool_call>\\n{"name": <function name>, "arguments": <arguments object>}\\n</tool_call>' -%}
{%- endif -%}
{%- if (effort is not none or ns.tools) and (messages | length == 0 or messages[0].role != 'system') -%}
{{- '<|im_start|>system\\n' -}}
{%- if effort is not none -%}{{- 'Reasoning effort: ' ~ effort ~ '.' ~ ('\\n\\n' if ns.tools else '') -}}{%- endif -%}
{{- ns.tools ~ '<|im_end|>\\n' -}}
{%- endif -%}
{%- for m in messages -%}
{%- set text = m.content or '' -%}
{%- if loop.first and m.role == 'system' -%}
{%- if effort is not none -%}{%- set text = text ~ '\\nReasoning effort: ' ~ effort ~ '.' -%}{%- endif -%}
{%- if ns.tools -%}{%- set text = text ~ '\\n\\n' ~ ns.tools -%}{%- endif -%}
{%- elif m.role == 'assistant' and loop.index0 < ns.last_user and '</think>' in text -%}
{%- set text = (text.split('</think>') | last).lstrip('\\n') -%}
{%- endif -%}
{%- set turn = namespace(text=text) -%}
{%- if m.role == 'assistant' -%}
{%- for call in m.tool_calls or [] -%}
{%- set turn.text = turn.text ~ ('\\n' if turn.text else '') ~ '<tool_call>\\n'
    ~ ({'name': call.function.name, 'arguments': call.function.arguments} | tojson) ~ '\\n</tool_call>' -%}
{%- endfor -%}
{%- endif -%}
{%- set text = turn.text -%}
{%- if m.role == 'tool' -%}
{%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
{{- '\\n<tool_response>\\n' ~ text ~ '\\n</tool_response>' -}}
{%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}
{%- else -%}
{{- '<|im_start|>' ~ m.role ~ '\\n' ~ text ~ '<|im_end|>\\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\\n' -}}
{%- if enable_thinking is defined and enable_thinking is false -%}
{{- '<think>\\n\\n</think>\\n\\n' -}}
{%- else -%}
{{- '<think>\\n' -}}
{%- endif -%}
{%- endif -%}
"""
# The same template for a model never trained to think: the empty think block unless enable_thinking is true.
NO_THINKING_TEMPLATE = CHAT_TEMPLATE.replace(
    "{%- if enable_thinking is defined and enable_thinking is false -%}",
    "{%- if not (enable_thinking is defined and enable_thinking is true) -%}",
)


def corpus() -> Iterator[str]:
    """Yield the fixed offline training texts: capped stdlib sources in sorted order, then sentences."""
    files: list[Path] = []
    for mod in CORPUS_MODULES:
        path = Path(mod.__file__)
        files.extend(path.parent.glob("*.py") if path.name == "__init__.py" else [path])
    budget = CORPUS_CHAR_CAP
    for path in sorted(files):
        if budget <= 0:
            break
        text = path.read_text(encoding="utf-8")[: min(FILE_CHAR_CAP, budget)]
        budget -= len(text)
        yield text
    yield from SENTENCES


def build_tokenizer(
    out_dir: Path, vocab_size: int, texts: Iterable[str] | None = None, template: str = CHAT_TEMPLATE
) -> dict[str, int]:
    """Train on texts (default: corpus()), write tokenizer.json, tokenizer_config.json and chat_template.jinja."""
    n_pieces = vocab_size - len(SPECIAL_TOKENS)
    if n_pieces < 256:
        raise ValueError(f"vocab_size must be at least {256 + len(SPECIAL_TOKENS)}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=n_pieces, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(corpus() if texts is None else texts, trainer=trainer)
    if tok.get_vocab_size() != n_pieces:
        raise ValueError(f"corpus only supports {tok.get_vocab_size()} BPE pieces, {n_pieces} requested")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    assert tok.get_vocab_size() == vocab_size and list(ids.values()) == list(range(n_pieces, vocab_size))

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "clean_up_tokenization_spaces": False,
        "chat_template": template,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    (out_dir / "chat_template.jinja").write_text(template, encoding="utf-8")
    return ids


def main(argv: list[str] | None = None) -> None:
    """Command line entry point: build the tokenizer into OUT."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path, help="output directory")
    parser.add_argument("--vocab-size", type=int, required=True, help="total vocab size including special tokens")
    args = parser.parse_args(argv)
    print(json.dumps(build_tokenizer(args.out, args.vocab_size)))


if __name__ == "__main__":
    main()
