"""The checkpoint's tokenizer as the server loads it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from model.shipped import SHIPPED_MODEL
from server.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[2]


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


def run_python(code: str, *path: Path) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter from the repo root, `path` first on its import path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, path), str(ROOT)])}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)


def test_transformers_imported_without_torch_loads_the_tokenizer_and_torch_imports_after() -> None:
    """The front end's import leaves torch out of a tokenizer's load and tokenizing; a later import of torch works."""
    code = (
        "import sys; from server.tokenizer import import_transformers_without_torch, load_tokenizer\n"
        "from model.shipped import SHIPPED_MODEL\n"
        "assert import_transformers_without_torch()\n"
        "assert load_tokenizer(SHIPPED_MODEL).encode('hello there') and 'torch' not in sys.modules\n"
        "import torch; print(torch.zeros(2).sum())"
    )
    done = run_python(code)
    assert done.returncode == 0 and done.stdout == "tensor(0.)\n", done.stderr
    assert "PyTorch was not found" not in done.stderr


def test_a_transformers_that_needs_torch_imports_with_it(tmp_path: Path) -> None:
    """Where transformers cannot import without torch, the front end's import leaves none of it half imported and
    transformers imports as usual, with torch."""
    (tmp_path / "transformers").mkdir()
    (tmp_path / "transformers" / "__init__.py").write_text("from transformers import part\nimport torch\n")
    (tmp_path / "transformers" / "part.py").write_text("")
    code = (
        "import sys; from server.tokenizer import import_transformers_without_torch\n"
        "assert not import_transformers_without_torch() and 'transformers.part' not in sys.modules\n"
        "import transformers; assert 'torch' in sys.modules and 'transformers.part' in sys.modules"
    )
    done = run_python(code, tmp_path)
    assert done.returncode == 0, done.stderr
