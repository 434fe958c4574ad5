"""The checkpoint's tokenizer and stop ids, through transformers."""

from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)


def load_tokenizer(model_dir: Path):
    """The checkpoint's tokenizer, or None when it ships none (token-id prompts still work)."""
    if not (model_dir / "tokenizer.json").is_file() and not (model_dir / "tokenizer_config.json").is_file():
        log.warning("%s has no tokenizer: only token-id prompts can be served", model_dir)
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def eos_token_ids(model_dir: Path, tokenizer, config_eos: int) -> tuple[int, ...]:
    """End-of-sequence ids: generation_config.json's, the tokenizer's, else the model config's."""
    ids: list[int] = []
    generation = model_dir / "generation_config.json"
    if generation.is_file():
        eos = json.loads(generation.read_text()).get("eos_token_id")
        ids.extend(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    if not ids:
        ids.append(config_eos)
    return tuple(dict.fromkeys(int(i) for i in ids))
