"""Broken checkpoint folders are refused at start naming the field, tensor or file (no traceback from inside torch,
no hang), and tensors the model does not take are named in a warning (no silent load)."""

from __future__ import annotations

import json
import math
import re
import shutil
import signal
from pathlib import Path

import pytest
import torch
from make_checkpoint import write_safetensors
from safetensors.torch import save_file

from model.config import ConfigError
from model.shipped import SHIPPED_MODEL
from model.weights import CheckpointError, TensorIndex, load_model
from server.cli import main
from tests.tiny import checkpoint

TABLE = "model.language_model.layers.0.ple.ple_embedding.ngram_embedding"


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    return checkpoint(tmp_path_factory.mktemp("good") / "m")


@pytest.fixture(scope="module")
def nvfp4(tmp_path_factory) -> Path:
    return checkpoint(tmp_path_factory.mktemp("nvfp4") / "m", fmt="nvfp4")


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(path: Path, **changes) -> Path:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))
    return path


def tensors_of(path: Path) -> dict[str, torch.Tensor]:
    index = TensorIndex(path)
    return {name: index.get(name).clone() for name in index.files}


def rewrite(src: Path, dst: Path, tensors: dict[str, torch.Tensor], shards: int = 1) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    write_safetensors(tensors, dst, shards)
    return dst


def config_only(folder: Path, *names: str) -> Path:
    """The shipped model's config (and the named files beside it), without weights."""
    folder.mkdir()
    for name in ("config.json", *names):
        shutil.copy(SHIPPED_MODEL / name, folder / name)
    return folder


def start(folder: Path, monkeypatch, capsys) -> tuple[int, str]:
    """`python -m server FOLDER` up to the point where it would load the weights."""
    import server.serve

    monkeypatch.setattr(server.serve, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    code = main(["serve", str(folder), "--port", "0"])
    return code, capsys.readouterr().err


# --- tensors the model does not take ---------------------------------------------------------------------------


def unused_warning(caplog) -> str:
    """The loader's warning about checkpoint tensors the model does not take ('' if none)."""
    return "\n".join(r.getMessage() for r in caplog.records if "not part of this model" in r.getMessage())


def test_a_checkpoint_with_more_layers_than_the_config_is_named(good, tmp_path, caplog):
    """A config whose num_hidden_layers is below the checkpoint's layers loads with a warning naming the unused
    layers' tensors."""
    path = edit_config(copy(good, tmp_path / "m"), num_hidden_layers=2)  # the checkpoint holds layers 0..3
    with caplog.at_level("WARNING", logger="model.weights"):
        load_model(path, dtype="float32")
    assert re.search(r"model\.layers\.[23]\.", unused_warning(caplog))


def test_ple_tensors_of_a_layer_the_config_gives_no_ple_are_named(good, tmp_path, caplog):
    """A checkpoint with a PLE layer under a config without ple_layer_ids loads with a warning naming its tensors."""
    path = edit_config(copy(good, tmp_path / "m"), ple_layer_ids=[])
    with caplog.at_level("WARNING", logger="model.weights"):
        load_model(path, dtype="float32")
    assert "model.layers.0.ple." in unused_warning(caplog)


def test_an_unknown_tensor_in_the_checkpoint_is_named_and_a_whole_one_is_not(good, tmp_path, caplog):
    """A tensor no parameter takes (here a q_proj bias, which would change the math) is named in a warning; a
    checkpoint the model takes whole loads with none."""
    with caplog.at_level("WARNING", logger="model.weights"):
        load_model(good, dtype="float32")
    assert unused_warning(caplog) == ""
    tensors = tensors_of(good)
    key = "model.layers.1.self_attn.q_proj.bias"
    tensors[key] = torch.ones(tensors["model.layers.1.self_attn.q_proj.weight"].shape[0])
    path = rewrite(good, tmp_path / "m", tensors)
    with caplog.at_level("WARNING", logger="model.weights"):
        load_model(path, dtype="float32")
    assert key in unused_warning(caplog)


def test_a_tensor_held_by_two_shards_without_an_index_is_refused(good, tmp_path):
    """Two *.safetensors files (no index) holding the same tensor are refused naming it, not the last file's taken."""
    path = copy(good, tmp_path / "m")
    key = "model.embed_tokens.weight"
    shape = TensorIndex(path).shape(key)
    save_file({key: torch.zeros(shape)}, path / "zz-extra.safetensors")
    with pytest.raises(CheckpointError, match=key.replace(".", r"\.")):
        load_model(path, dtype="float32")


# --- the index file --------------------------------------------------------------------------------------------


def test_an_index_file_that_is_not_utf8_is_refused_naming_it(good, tmp_path):
    """An index file of bytes that are not UTF-8 is a CheckpointError naming it, not a UnicodeDecodeError."""
    path = rewrite(good, tmp_path / "m", tensors_of(good), shards=2)
    (path / "model.safetensors.index.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json"):
        load_model(path, dtype="float32")


@pytest.mark.parametrize("file", [None, 5])
def test_an_index_entry_that_is_no_file_name_is_refused_naming_the_tensor(good, tmp_path, file):
    """A weight_map value that is not a string is a CheckpointError naming the tensor, not a TypeError."""
    path = rewrite(good, tmp_path / "m", tensors_of(good), shards=2)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    key = "model.layers.0.linear_attn.out_proj.weight"
    index["weight_map"][key] = file
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=key.replace(".", r"\.")):
        load_model(path, dtype="float32")


# --- quantization ----------------------------------------------------------------------------------------------


def test_an_ngram_table_shard_of_another_dtype_is_refused_naming_it(nvfp4, tmp_path):
    """An FP8 table with one BF16 shard is refused naming the shard, not torch.cat's Float8 promotion RuntimeError."""
    tensors = tensors_of(nvfp4)
    key = f"{TABLE}.shard_1.weight"
    tensors[key] = tensors[key].to(torch.bfloat16)
    path = rewrite(nvfp4, tmp_path / "m", tensors, shards=2)
    with pytest.raises(CheckpointError, match=r"ngram_embedding"):
        load_model(path, dtype="float32")


def test_an_hf_quant_config_that_is_not_utf8_is_refused_naming_the_file(tmp_path, monkeypatch, capsys):
    """hf_quant_config.json of bytes that are not UTF-8 is refused naming the file (not only "'utf-8' codec ...")."""
    folder = config_only(tmp_path / "m")
    (folder / "hf_quant_config.json").write_bytes(b"\xff\xfe{}")
    code, err = start(folder, monkeypatch, capsys)
    assert code == 2 and "hf_quant_config.json" in err, err


def test_quantized_layers_that_are_no_object_are_refused_naming_the_field(tmp_path, monkeypatch, capsys):
    """quantization_config.quantized_layers given as a list is refused at start naming it, not an AttributeError."""
    folder = config_only(tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["quantized_layers"] = ["model.language_model.layers.0.mlp.experts"]
    (folder / "config.json").write_text(json.dumps(config))
    code, err = start(folder, monkeypatch, capsys)
    assert code == 2 and "quantized_layers" in err, err


# --- config values ---------------------------------------------------------------------------------------------


def test_an_ngram_vocab_size_base_out_of_range_is_refused_quickly(good, tmp_path):
    """A huge ngram_vocab_size_base is refused within seconds naming it (or the table), not minutes of prime search."""
    path = edit_config(copy(good, tmp_path / "m"), ngram_vocab_size_base=10**18)

    def too_slow(signum, frame):
        raise TimeoutError("load_model took more than 5 s")

    previous = signal.signal(signal.SIGALRM, too_slow)
    signal.alarm(5)
    try:
        with pytest.raises((ConfigError, CheckpointError), match="ngram"):
            load_model(path, dtype="float32")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# --- generation_config / tokenizer -----------------------------------------------------------------------------


def test_a_generation_config_eos_id_outside_the_vocabulary_is_refused_at_start(tmp_path, monkeypatch, capsys):
    """generation_config.json's eos_token_id past vocab_size is refused at start naming the file (it was taken, and
    every request with min_tokens then failed with 500 "the round failed: index ... is out of bounds")."""
    folder = config_only(tmp_path / "m")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [4093, 4096 + 5]}))
    code, err = start(folder, monkeypatch, capsys)
    assert code == 2 and "generation_config.json" in err and "eos_token_id" in err, err


def test_a_tokenizer_eos_outside_the_vocabulary_is_refused_at_start(tmp_path, monkeypatch, capsys):
    """A checkpoint tokenizer whose eos token has an id past vocab_size (an eos_token it adds) is refused at start
    naming the eos token, not taken as a stop id that breaks every request with min_tokens."""
    folder = config_only(tmp_path / "m", "tokenizer.json", "tokenizer_config.json")
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    tok_config["eos_token"] = "<|no_such_token|>"  # transformers adds it as id 4096 of a 4096-row model
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    code, err = start(folder, monkeypatch, capsys)
    assert code == 2 and "eos" in err and "Traceback" not in err, err


def test_the_table_primes_are_trial_divisions_primes_and_a_large_base_is_quick():
    """The primality test the table sizes come from agrees with trial division, and finds primes past 10^12 at once."""
    from model.ple import _is_prime, _primes_after

    def by_division(n: int) -> bool:
        return n == 2 or (n > 2 and n % 2 == 1 and all(n % d for d in range(3, math.isqrt(n) + 1, 2)))

    assert [n for n in range(20_000) if _is_prime(n)] == [n for n in range(20_000) if by_division(n)]
    assert all(_is_prime(n) == by_division(n) for n in range(20_000_000 - 2_000, 20_000_000 + 2_000))
    assert all(by_division(p) for p in _primes_after(10**12, 4))


def test_an_mtp_tensor_the_model_built_with_mtp_does_not_take_is_named(tmp_path, caplog):
    """With MTP built (the checkpoint has mtp.*), an mtp.* tensor no parameter takes (here a q_proj bias) is named in
    the unused-tensor warning, as the same tensor in the trunk is (only a model built without MTP skips mtp.*)."""
    good = checkpoint(tmp_path / "good")
    index = TensorIndex(good)
    tensors = {name: index.get(name).clone() for name in index.files}
    weight = "mtp.layers.0.self_attn.q_proj.weight"
    assert weight in tensors
    extra = "mtp.layers.0.self_attn.q_proj.bias"
    tensors[extra] = torch.ones(tensors[weight].shape[0])
    path = tmp_path / "m"
    shutil.copytree(good, path, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    write_safetensors(tensors, path, 1)
    with caplog.at_level("WARNING", logger="model.weights"):
        model = load_model(path, dtype="float32")
    assert any(name.startswith("mtp.") for name, _ in model.named_parameters()), "the model was built without MTP"
    warned = "\n".join(r.getMessage() for r in caplog.records if "not part of this model" in r.getMessage())
    assert extra in warned, f"no warning names {extra}: {warned!r}"
