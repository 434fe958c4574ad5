"""The sampling values a request's unset fields take, as vLLM's `--generation-config` gives them: the model's
generation_config.json (auto), none (vllm), or another folder's, with `--override-generation-config` on top."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from server.protocol import MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY, SamplingDefaults
from server.tokenizer import GENERATION_FILE, read_generation_config
from server.vllm_flags import json_object

SOURCES = ("auto", "vllm")  # or a folder


def _number(value: object) -> bool:
    """A finite JSON number (not a bool)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _whole(value: object) -> bool:
    """A JSON integer (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool)


# each key the defaults take: (check, what it must be), the same bounds a request's field has
RULES = {
    "temperature": (lambda v: _number(v) and 0 <= v <= 2, "a number in [0, 2]"),
    "top_p": (lambda v: _number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "top_k": (lambda v: _whole(v) and v >= -1, "an integer of at least -1 (-1 and 0: off)"),
    "min_p": (lambda v: _number(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "repetition_penalty": (
        lambda v: _number(v) and MIN_REPETITION_PENALTY <= v <= MAX_REPETITION_PENALTY,
        f"a number in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY:g}]",
    ),
    "max_new_tokens": (lambda v: _whole(v) and v >= 1, "an integer of at least 1"),
}


def parse_overrides(text: str) -> dict[str, Any]:
    """`--override-generation-config`'s JSON object, each key one the defaults take with a value in its bounds."""
    data = json_object("--override-generation-config", text)
    for key, value in data.items():
        if key not in RULES:
            raise ValueError(f"--override-generation-config: {key!r} is not one of {', '.join(RULES)}")
        _check(key, value, "--override-generation-config")
    return data


def _check(key: str, value: object, where: str) -> None:
    """Refuse a value outside its key's bounds, naming where it came from."""
    check, expected = RULES[key]
    if not check(value):
        raise ValueError(f"{where}: {key} must be {expected}, got {value!r}")


def _file_values(folder: Path, named: bool) -> dict[str, Any]:
    """The sampling keys a folder's generation_config.json gives (none without the file, unless the folder was named
    for it), as vLLM on transformers 5 reads them: each key the file sets."""
    data = read_generation_config(folder)
    if data is None:
        if named:
            raise ValueError(f"--generation-config: no {GENERATION_FILE} in {folder}")
        return {}
    path = folder / GENERATION_FILE
    values = {}
    for key in RULES:
        value = data.get(key)
        if value is None:
            continue
        _check(key, value, f"{path} (--generation-config vllm leaves it unread)")
        values[key] = value
    return values


def read_sampling_defaults(
    model_dir: Path, source: str = "auto", overrides: dict[str, Any] | None = None
) -> SamplingDefaults:
    """The defaults from `--generation-config` (auto: the model folder's file; vllm: none; else that folder's) and
    the overrides on top. A max_new_tokens is the default max_tokens; an override's, or a named folder's, also
    caps every request, as vLLM caps it. Values out of bounds are refused naming the file or flag and the key."""
    named = source not in SOURCES
    values = {} if source == "vllm" else _file_values(Path(source) if named else model_dir, named)
    overrides = overrides or {}
    values.update(overrides)
    cap = values.get("max_new_tokens") if named else overrides.get("max_new_tokens")
    return SamplingDefaults(
        temperature=values.get("temperature"),
        top_p=values.get("top_p"),
        top_k=values.get("top_k"),
        min_p=values.get("min_p"),
        repetition_penalty=values.get("repetition_penalty"),
        max_tokens=values.get("max_new_tokens"),
        max_tokens_cap=cap,
    )


def defaults_from_flags(model_dir: Path, generation_config: str, override_text: str | None) -> SamplingDefaults:
    """The defaults of `--generation-config` and `--override-generation-config` (its JSON text, or None)."""
    overrides = parse_overrides(override_text) if override_text is not None else None
    return read_sampling_defaults(model_dir, generation_config, overrides)
