"""The checkpoint's tokenizer and stop ids, through transformers."""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class TokenizerError(ValueError):
    """A tokenizer, chat template or generation_config.json that does not load; the message names it."""


def load_tokenizer(model_dir: Path, chat_template: str | None = None, tokenizer_dir: Path | None = None):
    """The tokenizer of `tokenizer_dir` (--tokenizer) or else the checkpoint's, or None when the checkpoint ships
    none (token-id prompts still work); one that does not load, or a --tokenizer folder without one, is refused as a
    TokenizerError. `chat_template` (--chat-template's text) replaces the tokenizer's template."""
    folder = tokenizer_dir or model_dir
    if not (folder / "tokenizer.json").is_file() and not (folder / "tokenizer_config.json").is_file():
        if tokenizer_dir is not None:
            raise TokenizerError(
                f"--tokenizer: {folder} holds no tokenizer (no tokenizer.json or tokenizer_config.json)"
            )
        if chat_template is not None:
            raise TokenizerError(f"--chat-template: {model_dir} has no tokenizer to render it with")
        log.warning("%s has no tokenizer: only token-id prompts can be served", model_dir)
        return None
    from transformers import AutoTokenizer

    named = f"--tokenizer {folder}" if tokenizer_dir is not None else str(folder)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except Exception as exc:  # a broken file fails in json, tokenizers or transformers, each with its own errors
        raise TokenizerError(f"{named}: its tokenizer does not load ({type(exc).__name__}: {exc})") from exc
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    check_chat_template(tokenizer, "--chat-template: the" if chat_template is not None else f"{named}: its")
    clear_presets(tokenizer)
    return tokenizer


def import_transformers_without_torch() -> bool:
    """Import transformers with torch hidden while it imports, in a process that runs no model (the front end), so it
    takes torch as absent and never imports it; whether it did (else it imported as usual: torch was in already, or
    this transformers needs it)."""
    if "torch" in sys.modules or "transformers" in sys.modules:
        return False
    sys.modules["torch"] = None  # importlib's find_spec answers None, so transformers' torch check says absent
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # its "PyTorch was not found" advice
    try:
        import transformers  # noqa: F401

        return True
    except Exception:  # ImportError where it needs torch; any other failure is tried again with torch
        for name in [name for name in sys.modules if name.partition(".")[0] == "transformers"]:
            del sys.modules[name]
        return False
    finally:
        del sys.modules["torch"]


def check_vocab(tokenizer, vocab_size: int) -> None:
    """Refuse --tokenizer's tokenizer where its ids reach past the model's embedding rows: most likely another
    model's (a checkpoint's own is taken as it is; a prompt with an id past the rows is refused by request)."""
    if len(tokenizer) > vocab_size:
        raise TokenizerError(f"--tokenizer: its {len(tokenizer)} token ids exceed the model's vocab_size {vocab_size}")


def clear_presets(tokenizer) -> None:
    """Drop truncation and padding preset in tokenizer.json: no call here asks for either, and transformers would
    drop them at the first call, a change to the shared tokenizer that races calls on other threads."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return
    if backend.truncation is not None:
        backend.no_truncation()
    if backend.padding is not None:
        backend.no_padding()


def check_chat_template(tokenizer, whose: str) -> None:
    """Refuse a chat template with a syntax error, which every chat request would meet (`whose` names it: "MODEL:
    its" or a flag); one that refuses some conversations, or none at all, is the requests' business (text
    completions need none)."""
    from jinja2 import TemplateSyntaxError

    template = getattr(tokenizer, "chat_template", None)
    if template is not None and not all(isinstance(source, str) for source in _template_sources(tokenizer)):
        raise TokenizerError(f"{whose} chat template is not text (got {template!r:.60})")
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    except TemplateSyntaxError as exc:
        raise TokenizerError(f"{whose} chat template does not compile ({exc})") from exc
    except ImportError as exc:  # transformers' own check of the jinja2 it renders with
        raise TokenizerError(f"{whose} chat template cannot be rendered here ({exc})") from exc
    except Exception:  # a template that refuses this conversation, or no template at all
        pass


def template_reads(tokenizer, name: str) -> bool:
    """Whether the tokenizer's chat template (any of its named ones) reads the variable `name` (`tools`,
    `documents`): one that does not would drop what the request gives there without a word."""
    return any(name in _variables(source) for source in _template_sources(tokenizer) if isinstance(source, str))


def _template_sources(tokenizer) -> list[Any]:
    """The tokenizer's chat template sources: each named template's, or its one (None where it has none)."""
    template = getattr(tokenizer, "chat_template", None)
    return list(template.values()) if isinstance(template, dict) else [template]


@functools.lru_cache(maxsize=8)
def _variables(source: str) -> frozenset[str]:
    """The variables a template's source reads (every word in it, where jinja2 cannot parse it alone)."""
    from jinja2 import Environment, TemplateSyntaxError, meta

    try:
        parsed = Environment(extensions=["jinja2.ext.loopcontrols"]).parse(source)
    except TemplateSyntaxError:  # a tag only transformers' environment knows
        return frozenset(re.findall(r"\w+", source))
    return frozenset(meta.find_undeclared_variables(parsed))


GENERATION_FILE = "generation_config.json"


def read_generation_config(folder: Path) -> dict[str, Any] | None:
    """A folder's generation_config.json (None without one), refused naming the file when it is no JSON object."""
    path = folder / GENERATION_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:  # not JSON, or not UTF-8
        raise TokenizerError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def generation_eos_ids(model_dir: Path) -> list[int]:
    """generation_config.json's end-of-sequence ids (none without one), refused naming the file when malformed."""
    data = read_generation_config(model_dir) or {}
    eos = data.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
        raise TokenizerError(f"{GENERATION_FILE}: eos_token_id must be a token id or a list of them, got {eos!r}")
    return ids


def eos_token_ids(model_dir: Path, tokenizer, config_eos: int, vocab_size: int) -> tuple[int, ...]:
    """End-of-sequence ids: generation_config.json's (the model config's where the model has no such file, as vLLM
    makes one from its config) and the tokenizer's (which --tokenizer may take from another folder); else the model
    config's. An id past the model's vocabulary is refused naming where it came from."""
    has_file = (model_dir / GENERATION_FILE).is_file()
    ids = generation_eos_ids(model_dir) if has_file else [config_eos]
    outside = [i for i in ids if i >= vocab_size]
    if has_file and outside:
        raise TokenizerError(f"{GENERATION_FILE}: eos_token_id {outside[0]} is past the model's {vocab_size} tokens")
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        if tokenizer.eos_token_id >= vocab_size:
            raise TokenizerError(
                f"the tokenizer's eos_token {tokenizer.eos_token!r} has id {tokenizer.eos_token_id}, past the model's "
                f"{vocab_size} tokens"
            )
        ids.append(tokenizer.eos_token_id)
    if not ids:
        ids.append(config_eos)
    return tuple(dict.fromkeys(int(i) for i in ids))


def single_token_id(tokenizer, text: str) -> int | None:
    """The id of the one token that spells `text` (a tag like "</think>"), or None where no single token does."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None
