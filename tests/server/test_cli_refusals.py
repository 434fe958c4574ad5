"""The command line and start-up (helper-135's review): vLLM's API-key variable and several keys taken as vLLM takes
them, keys no HTTP header carries refused, and bad values refused at start naming the flag, before a model loads:
speculative configs, cache sizes, generate's seed and prompt, an empty override, two spellings of one setting that
disagree."""

from __future__ import annotations

import argparse
import json

import pytest

from model.shipped import SHIPPED_MODEL
from server.cli import build_parser, main, start_refusal
from server.settings import read_environment


def _last_error_line(capsys) -> str:
    """The last line argparse (or the start) wrote to stderr."""
    lines = capsys.readouterr().err.strip().splitlines()
    return lines[-1] if lines else ""


def start_refused(capsys, *flags: str) -> str | None:
    """Why `flashnext serve FLAGS` cannot start, found by the parser or by the start-up checks before any model
    loads (the parser's or start_refusal's message); None where both let it start."""
    try:
        args = build_parser().parse_args(["serve", *flags])
    except SystemExit as exc:
        assert exc.code == 2
        return _last_error_line(capsys)
    try:
        return start_refusal(args)
    except (ValueError, SystemExit) as exc:  # main prints these as refusals too
        return str(exc)


# --- VLLM_API_KEY ---------------------------------------------------------------------------------------------------


def test_vllms_api_key_variable_is_honoured_after_ours(monkeypatch, capsys):
    """vLLM's API server requires `VLLM_API_KEY` when --api-key is not given (api_server.py: `args.api_key or
    [envs.VLLM_API_KEY]`): so does this one, after its own FLASHNEXT_API_KEY; a malformed one is refused by name."""
    import server.serve

    for name in ("FLASHNEXT_API_KEY", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "sesame")
    seen: list[str | None] = []

    def serve_rank(args, *_rest):
        seen.append(args.api_key)
        return 0

    monkeypatch.setattr(server.serve, "serve_rank", serve_rank)
    assert main(["serve", "--host", "127.0.0.1", "--port", "0"]) == 0
    assert seen == [("sesame",)], "VLLM_API_KEY was ignored: the server would serve without authentication"
    monkeypatch.setenv("FLASHNEXT_API_KEY", "ours")
    assert main(["serve", "--host", "127.0.0.1", "--port", "0"]) == 0
    assert main(["serve", "--host", "127.0.0.1", "--port", "0", "--api-key", "flag"]) == 0
    assert seen[1:] == [("ours",), ("flag",)]  # the flag first, then this server's variable, then vLLM's
    monkeypatch.setenv("VLLM_API_KEY", "sesame ")
    assert main(["serve", "--host", "127.0.0.1", "--port", "0"]) == 2  # refused as a FLASHNEXT_ setting is
    assert "VLLM_API_KEY: malformed" in _last_error_line(capsys)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("FLASHNEXT_PDL", "2"),
        ("TRITON_DEFAULT_FP_FUSION", "0"),
        ("VLLM_API_KEY", "sesame "),
        ("FLASHNEXT_PEER_SUMS", "1"),
    ],
)
def test_serve_refuses_an_environment_setting_as_generate_and_the_flags_do(monkeypatch, capsys, name, value):
    """A setting the environment cannot give (malformed, or peer sums at --tp 1 on the CPU) is a refusal at start:
    exit 2 naming the variable, before serving begins, as generate and every flag refuse (serve exited 1)."""
    import server.serve

    for other in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv(name, value)
    monkeypatch.setattr(server.serve, "serve_rank", lambda *_args: pytest.fail("serving began"))
    assert main(["serve", "--host", "127.0.0.1", "--port", "0"]) == 2
    assert name in _last_error_line(capsys)


# --- --api-key ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["secret ", "secret\t", "sec\nret"])
def test_an_api_key_no_http_header_can_carry_is_refused_by_flag(capsys, key):
    """HTTP strips a header value's spaces at either end and cannot carry a line break: no client could give such a
    key (httpx refuses to send `Bearer secret `), so it is refused at start."""
    refusal = start_refused(capsys, "--api-key", key)
    assert refusal is not None and "--api-key" in refusal


@pytest.mark.parametrize("key", ["secret ", "sec\nret"])
def test_an_api_key_setting_no_http_header_can_carry_is_refused_by_name(key):
    """The same key in FLASHNEXT_API_KEY (an empty one is already refused by name)."""
    with pytest.raises(ValueError, match="FLASHNEXT_API_KEY"):
        read_environment({"FLASHNEXT_API_KEY": key})


def test_vllms_several_api_keys_are_taken(capsys):
    """vLLM's --api-key takes several keys (FrontendArgs.api_key: list[str], "the server will require one of these
    keys"): so does this one; a checkpoint folder among them is refused, as MODEL must come before the keys."""
    args = build_parser().parse_args(["serve", "--api-key", "k1", "k2"])
    assert args.model is SHIPPED_MODEL and args.api_key == ["k1", "k2"]
    with pytest.raises(SystemExit):  # a checkpoint folder after the keys: MODEL must come first
        build_parser().parse_args(["serve", "--api-key", "k1", str(SHIPPED_MODEL)])
    assert "give MODEL before --api-key" in _last_error_line(capsys)


# --- --speculative-config -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ['["mtp"]', "{}"])
def test_a_speculative_method_that_is_no_string_is_refused_by_flag_not_a_traceback(capsys, method):
    """A method that is no string is refused naming the flag (it was looked up in a dict: a TypeError's traceback)."""
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", "--speculative-config", f'{{"method": {method}}}'])
    assert exit_info.value.code == 2
    assert "--speculative-config" in _last_error_line(capsys)


@pytest.mark.parametrize(
    "lookup",
    [
        '"prompt_lookup_min": 5, "prompt_lookup_max": 2',
        '"prompt_lookup_max": -5',
        '"prompt_lookup_min": 0',
        '"prompt_lookup_max": "x"',
    ],
)
def test_ngram_lookup_lengths_vllm_refuses_are_refused_by_flag(capsys, lookup):
    """vLLM's SpeculativeConfig refuses prompt_lookup_min or _max below 1 and a min above the max: so does this server,
    which takes them and does not use them."""
    config = f'{{"method": "ngram", "num_speculative_tokens": 2, {lookup}}}'
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", "--speculative-config", config])
    assert exit_info.value.code == 2
    line = _last_error_line(capsys)
    assert "--speculative-config" in line and "prompt_lookup" in line


# --- numbers --------------------------------------------------------------------------------------------------------


def test_a_prompt_cache_too_large_to_count_in_bytes_is_refused_by_flag(capsys):
    """A size whose bytes overflow a float (1e300 GiB) is refused at start (it raised OverflowError after the model
    loaded)."""
    refusal = start_refused(capsys, "--prompt-cache-gib", "1e300")
    assert refusal is not None and "--prompt-cache-gib" in refusal


def test_generate_refuses_a_seed_outside_the_apis_range_by_flag(capsys):
    """The API takes seeds in [-2**63, 2**63 - 1]; so does `generate --seed` (it drew with any integer modulo 2**64)."""
    for seed in (str(2**64 + 11), str(-(2**63) - 1)):
        with pytest.raises(SystemExit) as exit_info:
            build_parser().parse_args(["generate", "--prompt-ids", "1", "--seed", seed])
        assert exit_info.value.code == 2
        assert "--seed" in _last_error_line(capsys)


# --- generate's prompt ----------------------------------------------------------------------------------------------


def _no_model_load(monkeypatch):
    import model.weights

    def refuse(*_args, **_kwargs):
        raise AssertionError("the model was loaded before the flags were refused")

    monkeypatch.setattr(model.weights, "load_model", refuse)


def test_an_empty_generate_prompt_is_refused_naming_prompt_before_the_model_loads(monkeypatch, capsys):
    """`flashnext generate --prompt ""` is refused naming --prompt, before the model loads."""
    _no_model_load(monkeypatch)
    assert main(["generate", "--prompt", ""]) == 2
    err = capsys.readouterr().err
    assert "--prompt" in err and "--prompt-ids" not in err


@pytest.mark.parametrize(
    ("flags", "named"),
    [(["--prompt-ids", "7,99999"], "--prompt-ids"), (["--prompt-ids", "1,2", "--max-tokens", "5000"], "--max-tokens")],
)
def test_generate_refuses_what_the_config_rules_out_before_the_model_loads(monkeypatch, capsys, flags, named):
    """The vocab size and the positions are the config's, read at start: ids past the vocabulary and a --max-tokens
    past the positions are refused before the weights load (minutes for the real model)."""
    _no_model_load(monkeypatch)
    assert main(["generate", *flags]) == 2
    assert named in capsys.readouterr().err


# --- generation config ----------------------------------------------------------------------------------------------


def test_an_empty_override_generation_config_is_refused_by_flag(capsys):
    """`--override-generation-config ''` is no JSON object: refused naming the flag, as `--speculative-config ''` is."""
    refusal = start_refused(capsys, "--override-generation-config", "")
    assert refusal is not None and "--override-generation-config" in refusal


# --- conflicting spellings ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags",
    [
        ("--context", "512", "--max-model-len", "1024"),
        ("--max-lanes", "3", "--max-num-seqs", "5"),
        ("--tp", "1", "--tensor-parallel-size", "2"),
        ("--prompt-budget", "64", "--max-num-batched-tokens", "128"),
    ],
)
def test_a_vllm_flag_and_this_servers_that_disagree_are_refused_naming_both(capsys, flags):
    """One setting under this server's name and vLLM's with two values is refused naming both (the last spelling won
    without a word); one spelling given twice is argparse's, the last value."""
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", *flags])
    assert exit_info.value.code == 2
    line = _last_error_line(capsys)
    assert flags[0] in line and flags[2] in line
    assert build_parser().parse_args(["serve", *flags[:2], *flags[:2]]).given_spellings
    agreeing = build_parser().parse_args(["serve", *flags[:2], flags[2], flags[1]])  # the same value twice: taken
    assert str(vars(agreeing)[next(iter(agreeing.given_spellings))]) == flags[1]


# --- config.json ----------------------------------------------------------------------------------------------------


def shipped_with(folder, top: dict | None = None, text: dict | None = None) -> str:
    """The shipped model's files linked into `folder`, its config.json with `top` and `text_config` fields set."""
    for item in SHIPPED_MODEL.iterdir():
        (folder / item.name).symlink_to(item)
    (folder / "config.json").unlink()
    config = json.loads((SHIPPED_MODEL / "config.json").read_text())
    config = {**config, **(top or {}), "text_config": {**config["text_config"], **(text or {})}}
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.mark.parametrize(("field", "value"), [("tie_word_embeddings", "yes"), ("dtype", "float99"), ("dtype", 7)])
def test_a_bad_top_level_config_field_is_refused_by_name_not_as_the_tokenizer(tmp_path, capsys, field, value):
    """The shipped model's folder with its wrapper's own tie_word_embeddings or dtype bad: refused at start naming
    the field (it was "its tokenizer does not load", from transformers reading the same file; a dtype of 7 ran)."""
    model = shipped_with(tmp_path, top={field: value})
    assert main(["generate", model, "--prompt-ids", "1,2", "--max-tokens", "1"]) == 2
    line = _last_error_line(capsys)
    assert line.startswith(f"{field}: ") and "tokenizer" not in line


@pytest.mark.parametrize(
    "text", [{"hc_count": 10**9}, {"make_ngram_vocab_size_divisible_by": 2**40}, {"num_hidden_layers": 10**6}]
)
@pytest.mark.parametrize("tp", ["1", "2"])
def test_dummy_weights_no_memory_holds_are_refused_at_start(tmp_path, monkeypatch, capsys, text, tp):
    """Sizes no machine holds, served with dummy weights: refused naming --load-format (they overflowed a storage
    size, failed to allocate 12 TB, or built layers without end)."""
    import server.serve

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(server.serve, "serve_rank", lambda *_args: pytest.fail("serving began"))
    monkeypatch.setattr(server.serve, "launch", lambda *_args, **_kw: pytest.fail("the ranks were started"))
    model = shipped_with(tmp_path, text=text)
    assert main(["serve", model, "--load-format", "dummy", "--tp", tp, "--host", "127.0.0.1", "--port", "0"]) == 2
    assert _last_error_line(capsys).startswith("--load-format dummy: config.json's shapes need at least")


# --- messages and help ----------------------------------------------------------------------------------------------


def test_an_empty_chat_template_is_the_checkpoints():
    """`--chat-template ''` is none, as vLLM reads an empty value: the checkpoint's template (it was refused as "''
    is a folder")."""
    assert build_parser().parse_args(["serve", "--chat-template", ""]).chat_template is None


def test_context_help_says_the_lanes_decide_the_default_on_the_kernel_path():
    """--help says how the default context is lowered on the kernel path: until --max-lanes lanes fit."""
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    action = next(a for a in serve._actions if "--context" in a.option_strings)
    assert isinstance(action, argparse.Action) and "--max-lanes" in action.help
