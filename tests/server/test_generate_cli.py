"""`flashnext generate` against transformers' greedy generate on tiny checkpoints."""

from __future__ import annotations

import json

import pytest
import torch

from server.cli import main
from tests.tiny import checkpoint, hf_model, ties_to_lower_index


def run_cli(capsys, *argv: str) -> dict:
    assert main(["generate", *argv]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("variant", ["base", "gqa12-hc4"])
def test_greedy_generate_reproduces_transformers(variant, tmp_path, capsys):
    hf = hf_model(variant)
    prompt = [7, 19, 5, 33, 2, 91, 5, 44, 8, 13, 21, 60]  # EOS (5) inside the prompt
    new = 24  # decoding runs past the indexer budget, so sparse selection happens while decoding too
    with torch.no_grad(), ties_to_lower_index():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False)
    expected = expected[0, len(prompt) :].tolist()
    path = checkpoint(tmp_path / variant, variant)
    got = run_cli(
        capsys,
        str(path),
        "--prompt-ids",
        ",".join(map(str, prompt)),
        "--max-tokens",
        str(new),
        "--temperature",
        "0",
        "--ignore-eos",
        "--dtype",
        "float32",
    )
    assert got["token_ids"] == expected
    assert got["text"] == ""  # this checkpoint has no tokenizer


def test_seeded_sampling_is_repeatable_and_seed_dependent(tmp_path, capsys):
    path = str(checkpoint(tmp_path / "m"))
    args = ("--prompt-ids", "7,8,9", "--max-tokens", "12", "--temperature", "1.0", "--ignore-eos")
    first = run_cli(capsys, path, *args, "--seed", "11")["token_ids"]
    again = run_cli(capsys, path, *args, "--seed", "11")["token_ids"]
    other = run_cli(capsys, path, *args, "--seed", "12")["token_ids"]
    assert first == again and first != other


def test_generation_stops_at_eos(tmp_path, capsys):
    path = str(checkpoint(tmp_path / "m"))
    greedy = run_cli(capsys, path, "--prompt-ids", "7,8,9", "--max-tokens", "30", "--temperature", "0", "--ignore-eos")[
        "token_ids"
    ]
    eos = greedy[4]
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    stopped = run_cli(capsys, path, "--prompt-ids", "7,8,9", "--max-tokens", "30", "--temperature", "0")
    assert stopped["token_ids"] == greedy[: greedy.index(eos) + 1]


def test_bad_prompt_ids_are_refused_by_name(tmp_path, capsys):
    path = str(checkpoint(tmp_path / "m"))
    assert main(["generate", path, "--prompt-ids", "7,99999"]) == 2
    assert "--prompt-ids" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", path, "--prompt-ids", "7,x"])
    assert "--prompt-ids" in capsys.readouterr().err
    assert main(["generate", path, "--prompt", "hello"]) == 2
    assert "has no tokenizer" in capsys.readouterr().err


def test_a_prompt_and_max_tokens_past_the_models_positions_are_refused_by_name(tmp_path, capsys):
    """As the server refuses them (context_length_exceeded): the model was never run at those positions."""
    path = checkpoint(tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 8}))
    assert run_cli(capsys, str(path), "--prompt-ids", "7,8,9", "--max-tokens", "5", "--ignore-eos")["token_ids"]
    assert main(["generate", str(path), "--prompt-ids", "7,8,9", "--max-tokens", "6", "--ignore-eos"]) == 2
    assert "--max-tokens: 6 after a prompt of 3 tokens exceeds the model's 8 positions" in capsys.readouterr().err


def test_the_shipped_model_generates_from_text(capsys):
    out = run_cli(capsys, "--prompt", "def add(a, b):", "--max-tokens", "6", "--temperature", "0", "--ignore-eos")
    assert len(out["token_ids"]) == 6 and isinstance(out["text"], str)


@pytest.mark.parametrize(("name", "value"), [("FLASHNEXT_PDL", "2"), ("TRITON_DEFAULT_FP_FUSION", "0")])
def test_a_malformed_environment_setting_is_refused_by_name_before_the_model_loads(capsys, monkeypatch, name, value):
    """The kernels read FLASHNEXT_PDL, _GLUON and _OVERLAP (and Triton its FP fusion) here as in served rounds, which
    refuse a malformed value; generate read none of them at start, and took FLASHNEXT_PDL=2 as on."""
    import model.weights

    monkeypatch.setenv(name, value)
    monkeypatch.setattr(model.weights, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    assert main(["generate", "--prompt-ids", "1,2", "--max-tokens", "1"]) == 2
    assert name in capsys.readouterr().err


def test_a_tiny_positive_temperature_is_raised_to_the_apis_floor(capsys):
    """1e-300 passed the parser's [0, 100] and then overflowed the logits: a traceback after the model loaded. It is
    drawn at 0.01, as the API (and vLLM) raise it."""
    at_floor = main(["generate", "--prompt-ids", "1,2", "--max-tokens", "3", "--temperature", "1e-300", "--seed", "4"])
    tiny = capsys.readouterr().out
    assert at_floor == 0 and main(["generate", "--prompt-ids", "1,2", "--max-tokens", "3", "--temperature", "0.01",
                                   "--seed", "4"]) == 0  # fmt: skip
    assert capsys.readouterr().out == tiny
