"""The checkpoint's tokenizer as the server loads it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from model.shipped import SHIPPED_MODEL
from server.tokenizer import load_tokenizer


def test_truncation_and_padding_preset_in_the_file_are_dropped_at_load(tmp_path: Path):
    """Prompts are tokenized on worker threads: a preset that the first call drops would change the shared
    tokenizer while another thread uses it, and would have cut this prompt to 8 tokens had it been honoured."""
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(SHIPPED_MODEL / name, tmp_path / name)
    data = json.loads((tmp_path / "tokenizer.json").read_text())
    data["truncation"] = {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}
    data["padding"] = {
        "strategy": {"Fixed": 16}, "direction": "Right", "pad_to_multiple_of": None, "pad_id": 0, "pad_type_id": 0,
        "pad_token": "<pad>",
    }  # fmt: skip
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    tokenizer = load_tokenizer(tmp_path)
    backend = tokenizer.backend_tokenizer
    assert backend.truncation is None and backend.padding is None
    assert len(backend.encode("hello world " * 20, add_special_tokens=False).ids) > 16


def test_a_chat_template_that_this_jinja2_cannot_render_is_refused_at_load(tmp_path: Path, monkeypatch):
    """transformers refuses to render with a jinja2 older than it needs (an ImportError); taken as a template
    that refuses a conversation, that passed the start, and every chat request was answered 400 blaming it."""
    from transformers import PreTrainedTokenizerBase

    from server.tokenizer import TokenizerError

    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(SHIPPED_MODEL / name, tmp_path / name)

    def old_jinja2(self, *args, **kwargs):
        raise ImportError("apply_chat_template requires jinja2>=3.1.6 to be installed")

    monkeypatch.setattr(PreTrainedTokenizerBase, "apply_chat_template", old_jinja2)
    with pytest.raises(TokenizerError, match=f"{tmp_path}: its chat template cannot be rendered here"):
        load_tokenizer(tmp_path)
