"""`python -m server` / `flashnext serve`: starts with no model (the shipped one) and answers a chat request."""

from __future__ import annotations

import json
import os
import queue
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from model.shipped import SHIPPED_MODEL
from server.cli import build_parser, main
from server.ranks import free_port
from server.settings import read_environment
from tests.server.test_tp_server import stop, wait_healthy

ROOT = Path(__file__).resolve().parents[2]


def spawn_server(*flags: str, **env: str) -> subprocess.Popen:
    """`python -m server --host 127.0.0.1 FLAGS` from the repo root, its stderr piped, with `env` added to ours."""
    return subprocess.Popen(
        [sys.executable, "-m", "server", "--host", "127.0.0.1", *flags],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TQDM_DISABLE": "1", **env},
    )


def test_serve_with_no_model_answers_a_chat_request():
    port = free_port()
    proc = spawn_server("--port", str(port))
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        question = "Write a Python function that returns the sum of a list of numbers."
        reply = api.chat.completions.create(
            model="flashnext-small", max_tokens=16, temperature=0, messages=[{"role": "user", "content": question}]
        )
        assert reply.usage.completion_tokens >= 1 and reply.choices[0].finish_reason in ("stop", "length")
        assert "def " in reply.choices[0].message.content  # the shipped model was trained on Python
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_serve_help_explains_every_flag_and_its_default():
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    text = serve.format_help()
    for action in serve._actions:
        if action.option_strings and action.dest != "help":
            assert action.option_strings[-1] in text
            assert action.help and ("default" in action.help or action.choices), action.dest


def test_vllms_names_of_the_context_lanes_and_tp_flags_are_taken_too():
    parse = build_parser().parse_args
    ours = parse(["serve", "--context", "512", "--max-lanes", "3", "--tp", "2"])
    theirs = parse(["serve", "--max-model-len", "512", "--max-num-seqs", "3", "--tensor-parallel-size", "2"])
    assert (theirs.context, theirs.max_lanes, theirs.tp) == (ours.context, ours.max_lanes, ours.tp) == (512, 3, 2)


def test_chat_template_replaces_the_checkpoints_for_every_render(tmp_path):
    """--chat-template (a file or the text) is the template the routes render with, in the engine's process and in
    the front end's (it travels in the front's settings)."""
    from server.serve import create_serving
    from server.tokenizer import load_tokenizer

    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    for value in (str(tmp_path / "t.jinja"), template):
        args = build_parser().parse_args(["serve", "--chat-template", value])
        assert args.chat_template == template
    serving = create_serving(args)
    assert serving.front.chat_template == template and serving.tokenizer.chat_template == template
    front_tokenizer = load_tokenizer(serving.front.model_path, serving.front.chat_template)
    chat = [{"role": "user", "content": "hi"}]
    assert front_tokenizer.apply_chat_template(chat, tokenize=False) == "[user] hi\n"
    assert load_tokenizer(SHIPPED_MODEL).apply_chat_template(chat, tokenize=False) != "[user] hi\n"


def test_rounds_are_planned_ahead_unless_asked_not_to():
    """--plan-ahead is on by default: at the real shapes it won at one and eight streams (docs/performance.md,
    forty-fourth session); the flag turns it off, which the shipped model's single stream prefers."""
    assert build_parser().parse_args(["serve"]).plan_ahead == "on"
    assert build_parser().parse_args(["serve", "--plan-ahead", "off"]).plan_ahead == "off"


def test_a_bad_flag_is_refused_by_name(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", "--max-lanes", "0"])
    assert exit_info.value.code == 2
    assert "--max-lanes" in capsys.readouterr().err


def test_the_lane_pool_is_sized_from_free_memory_and_a_pool_that_cannot_fit_is_refused_by_flag():
    from server.serve import POOL_SHARE, pool_context

    per_position = 1000
    slot_bytes = lambda n: per_position * n  # noqa: E731
    free = int(9 * 4096 * per_position / POOL_SHARE)  # room for 8 slots and the scratch slot of 4096 positions
    assert pool_context(None, 65536, slot_bytes, 8, free) == 4096
    assert pool_context(None, 65536, slot_bytes, 8, free + 9 * 300 * per_position // POOL_SHARE) == 4352
    assert pool_context(None, 3000, slot_bytes, 8, free) == 3000  # the model's own when it fits
    assert pool_context(2000, 65536, slot_bytes, 8, free) == 2000
    with pytest.raises(SystemExit, match=r"--context 8192 with --max-lanes 8: .*lower --context or --max-lanes"):
        pool_context(8192, 65536, slot_bytes, 8, free)
    with pytest.raises(SystemExit, match="--max-lanes 100000"):
        pool_context(None, 65536, slot_bytes, 100000, free)


def test_cuda_graphs_on_without_their_needs_is_refused_by_flag():
    from server.serve import resolve_graphs

    assert resolve_graphs("auto", True, "cuda") and not resolve_graphs("auto", True, "cpu")
    assert not resolve_graphs("auto", False, "cuda") and not resolve_graphs("off", True, "cuda")
    with pytest.raises(SystemExit, match="--cuda-graphs on: needs --kernels on and --device cuda"):
        resolve_graphs("on", False, "cuda")
    with pytest.raises(SystemExit, match="--cuda-graphs on"):
        resolve_graphs("on", True, "cpu")
    assert not resolve_graphs("auto", True, "cuda", "host")  # a graph cannot gather table rows from host memory
    with pytest.raises(SystemExit, match="--cuda-graphs on: needs --ngram-table device, not host"):
        resolve_graphs("on", True, "cuda", "host")


def test_peer_sums_without_two_cuda_ranks_on_the_kernels_are_refused_by_name():
    from server.settings import peer_sums_refusal

    on, off = read_environment({"FLASHNEXT_PEER_SUMS": "1"}), read_environment({})
    assert on.peer_sums and not off.peer_sums
    args = build_parser().parse_args(["serve", "--device", "cuda"])
    assert peer_sums_refusal(on, 2, args) is None and peer_sums_refusal(off, 1, args) is None
    want = "FLASHNEXT_PEER_SUMS=1: peer sums need --tp 2, --device cuda and the kernels on (--kernels auto or on)"
    refused = ((1, ["--device", "cuda"]), (2, ["--device", "cpu"]), (2, ["--device", "cuda", "--kernels", "off"]))
    for world, flags in refused:
        assert peer_sums_refusal(on, world, build_parser().parse_args(["serve", *flags])) == want
    with pytest.raises(ValueError, match="FLASHNEXT_PEER_SUMS"):
        read_environment({"FLASHNEXT_PEER_SUMS": "yes"})


@pytest.mark.parametrize("value", ["inf", "nan", "1e10", "1e300"])
def test_a_tp_timeout_that_some_wait_cannot_take_is_refused_by_name(value):
    """1e10 passed as positive and finite, and rank 0 crashed with an OverflowError naming nothing when the control
    link's accept set its socket timeout (ten times the setting)."""
    with pytest.raises(ValueError, match="FLASHNEXT_TP_TIMEOUT_S"):
        read_environment({"FLASHNEXT_TP_TIMEOUT_S": value})


@pytest.mark.parametrize("rank", [0, 1])
def test_ranks_that_do_not_meet_within_the_tp_timeout_are_refused_naming_it(rank):
    """Rank 0 waits ten times FLASHNEXT_TP_TIMEOUT_S for rank 1 to connect and rank 1 as long for rank 0 to accept;
    1e-9 passed, and the wait's TimeoutError ended the rank in a traceback."""
    from server.ranks import RankEnv
    from server.serve import connect_ranks

    env = read_environment({"FLASHNEXT_TP_TIMEOUT_S": "0.01", "FLASHNEXT_LINK_PORT": str(free_port())})
    with pytest.raises(SystemExit, match=r"FLASHNEXT_TP_TIMEOUT_S=0\.01: rank \d .* within 0\.1 s"):
        connect_ranks(build_parser().parse_args(["serve"]), RankEnv(rank=rank, world=2), env)


def test_the_longest_tp_timeout_allowed_is_taken_by_every_wait_it_reaches():
    """The process group's timedelta, the link's socket timeouts (ten times it) and poll(2) in milliseconds."""
    import datetime
    import select

    from server.settings import MAX_TIMEOUT_S

    seconds = read_environment({"FLASHNEXT_TP_TIMEOUT_S": str(MAX_TIMEOUT_S)}).tp_timeout_s
    datetime.timedelta(seconds=seconds)
    with socket.socket() as sock:
        sock.settimeout(seconds * 10)
    read, write = os.pipe()
    try:
        os.write(write, b"x")
        poller = select.poll()
        poller.register(read, select.POLLIN)
        assert poller.poll(seconds * 1e3)  # ready: returns at once
    finally:
        os.close(read)
        os.close(write)


@pytest.mark.parametrize(
    ("name", "value", "refused"),
    [("TRITON_DEFAULT_FP_FUSION", "0", True), ("TRITON_DEFAULT_FP_FUSION", "off", True),
     ("TRITON_DEFAULT_FP_FUSION", "1 ", True), ("TRITON_FORCE_DISABLE_FP_FUSION", "Yes", True),
     ("TRITON_FORCE_DISABLE_FP_FUSION", "1", True), ("TRITON_DEFAULT_FP_FUSION", "1", False),
     ("TRITON_DEFAULT_FP_FUSION", "True", False), ("TRITON_FORCE_DISABLE_FP_FUSION", "0", False)],
)  # fmt: skip
def test_a_triton_setting_that_turns_off_fused_multiply_adds_is_refused_by_name(name, value, refused):
    if refused:
        with pytest.raises(ValueError, match=name):
            read_environment({name: value})
    else:
        read_environment({name: value})


def test_serve_refuses_triton_fp_fusion_off_before_the_model_loads():
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRITON_")}
    proc, _ = serve_on_a_taken_port({**env, "TRITON_DEFAULT_FP_FUSION": "0"})  # not refused: it stops on the port
    assert proc.returncode == 2
    assert "TRITON_DEFAULT_FP_FUSION='0' turns off the fused multiply-adds" in proc.stderr
    assert "cannot listen there" not in proc.stderr


def test_the_graphs_are_sized_from_the_lanes_drafts_and_prompt_budget(tmp_path, monkeypatch):
    """Verify graphs up to every lane's window (at most VERIFY_ROWS), prompt chunks beside them, and listed logits
    for every lane's window: a round's draws."""
    import argparse

    from make_checkpoint import make_checkpoint

    from model import kernel_path
    from model.kernel_blocks import SharedOutputs
    from model.weights import load_model
    from server import serve
    from tests.tiny import text_config

    monkeypatch.setitem(os.environ, "TRITON_INTERPRET", "1")
    text = text_config("base", linear_key_head_dim=16, linear_value_head_dim=16)
    model = load_model(make_checkpoint(text, tmp_path, fmt="bf16"), dtype="bfloat16", kernels="on")
    asked = []

    class Captured:
        buckets, shared = {}, SharedOutputs()

    def enable_graphs(_model, rows, listed_logits):
        asked.append((rows, listed_logits))
        return Captured()

    monkeypatch.setattr(serve, "resolve_graphs", lambda *_: True)
    monkeypatch.setattr(kernel_path, "enable_graphs", enable_graphs)
    for lanes, drafts in ((5, 2), (32, 3)):
        args = argparse.Namespace(
            context=64, max_lanes=lanes, cuda_graphs="on", ngram_table="device", prompt_budget=100, drafts=drafts
        )
        serve.plan_lanes(args, model)
    windows = (15, 128)
    assert asked == [
        ({"trunk": 100 + w, "verify": min(w, serve.VERIFY_ROWS), "prompt": 100 + w, "mtp": 100 + w}, w) for w in windows
    ]


def test_graphs_that_run_out_of_memory_at_capture_are_refused_naming_the_flags(tmp_path, monkeypatch):
    """The lane pool takes its share of the free memory first; capturing the largest buckets may need more than is
    left (the real shapes' half on one 80 GB GPU at 64 lanes): a refusal names what to lower, not a traceback."""
    import argparse

    from make_checkpoint import make_checkpoint

    from model import kernel_path
    from model.weights import load_model
    from server import serve
    from tests.tiny import text_config

    monkeypatch.setitem(os.environ, "TRITON_INTERPRET", "1")
    text = text_config("base", linear_key_head_dim=16, linear_value_head_dim=16)
    model = load_model(make_checkpoint(text, tmp_path, fmt="bf16"), dtype="bfloat16", kernels="on")

    def out_of_memory(*_args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 MiB.")

    monkeypatch.setattr(serve, "resolve_graphs", lambda *_: True)
    monkeypatch.setattr(kernel_path, "enable_graphs", out_of_memory)
    args = argparse.Namespace(
        context=64, max_lanes=5, cuda_graphs="on", ngram_table="device", prompt_budget=100, drafts=2
    )
    with pytest.raises(SystemExit) as refused:
        serve.plan_lanes(args, model)
    assert "--cuda-graphs: capturing rounds of up to 115 rows ran out of GPU memory" in str(refused.value)
    assert "lower --max-lanes, --prompt-budget or --context, or pass --cuda-graphs off" in str(refused.value)


def serve_on_a_taken_port(env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, int]:
    """`python -m server` (the shipped model) asked to listen on a port another socket holds, and that port."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "server", "--host", "127.0.0.1", "--port", str(port)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        taken.close()
    return proc, port


def test_a_port_in_use_is_refused_by_flag_before_the_model_loads():
    proc, port = serve_on_a_taken_port()
    assert proc.returncode == 1
    assert f"--host 127.0.0.1 --port {port}: cannot listen there" in proc.stderr
    assert "loaded" not in proc.stderr  # refused before any weights were read


def broken_checkpoint(folder: Path, config: str) -> Path:
    """A folder with a config.json of `config` and nothing else."""
    folder.mkdir()
    (folder / "config.json").write_text(config)
    return folder


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--port", "70000"], "--port"),
        (["--port", "-1"], "--port"),
        (["--prompt-cache-gib", "nan"], "--prompt-cache-gib"),
        (["--prompt-cache-gib", "-1"], "--prompt-cache-gib"),
        (["--api-key", ""], "--api-key: must not be empty"),
        (["--max-lanes", "1.5"], "--max-lanes/--max-num-seqs: expected a whole number"),
        (["--max-lanes", "1000000000"], "--max-lanes/--max-num-seqs: at most 65535"),
        (["--chat-template", "no/such/file.jinja"], "--chat-template: no file 'no/such/file.jinja'"),
        (["--chat-template", "configs"], "--chat-template: 'configs' is a folder"),
        (["--chat-template", "pyproject.toml"], "--chat-template: 'pyproject.toml' holds no Jinja template"),
        (
            ["--chat-template", "model/checkpoints/flashnext-small/model-00001-of-00001.safetensors"],
            "cannot be read as UTF-8",
        ),
    ],
)
def test_malformed_flag_values_are_refused_by_the_parser_naming_the_flag(capsys, flags, named):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", *flags])
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--context", "100000"], "--context: 100000 exceeds the model's"),
        (["--served-model-name", " "], "--served-model-name: must not be empty"),
        (["--cuda-graphs", "on"], "--cuda-graphs on: needs --kernels on and --device cuda"),
        (["--chat-template", "{% if %}"], "--chat-template: the chat template does not compile"),
        (["configs/qwen3.8-flash-next", "--chat-template", "{{ 1 }}"], "has no tokenizer to render it with"),
    ],
)
def test_flags_that_cannot_serve_are_refused_before_the_model_loads(capsys, monkeypatch, flags, message):
    import server.serve

    monkeypatch.setattr(server.serve, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    assert main(["serve", *flags]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"vocab_size": 4095}, "vocab_size (4095) does not split over 2 ranks"),
        (
            {"linear_num_key_heads": 3, "linear_num_value_heads": 6},
            "linear_num_value_heads: a rank's value heads must share whole key heads",
        ),
        (
            {"moe_intermediate_size": 48},  # halves of 24 columns: NVFP4's scales cover 16 columns each
            "moe_intermediate_size: 48 gives rank 0 the columns [0, 24), not whole 16-wide NVFP4 scale blocks",
        ),
    ],
)
def test_tp_2_on_a_model_that_does_not_split_is_refused_before_the_ranks_start(
    tmp_path, capsys, monkeypatch, fields, message
):
    import server.serve

    config = json.loads((SHIPPED_MODEL / "config.json").read_text())
    config["text_config"].update(fields)
    folder = broken_checkpoint(tmp_path / "odd", json.dumps(config))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(server.serve, "launch", lambda *a, **k: pytest.fail("the ranks were started"))
    assert main(["serve", str(folder), "--tp", "2", "--load-format", "dummy"]) == 2
    assert f"--tp 2: {message}" in capsys.readouterr().err


@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_nvfp4_experts_whose_width_is_not_whole_scale_blocks_are_refused_before_loading(
    tmp_path, capsys, monkeypatch, load_format
):
    """The shipped config quantizes its experts to NVFP4 (and dummy weights always are): 40 columns are 2.5 blocks."""
    import server.serve

    config = json.loads((SHIPPED_MODEL / "config.json").read_text())
    config["text_config"]["moe_intermediate_size"] = 40
    folder = broken_checkpoint(tmp_path / "odd", json.dumps(config))
    monkeypatch.setattr(server.serve, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    assert main(["serve", str(folder), "--load-format", load_format]) == 2
    assert "moe_intermediate_size: 40 gives rank 0 the columns [0, 40), not whole 16-wide" in capsys.readouterr().err


def test_bf16_experts_of_any_width_pass_the_block_check(tmp_path) -> None:
    """Without NVFP4 experts the width needs no 16-wide blocks."""
    from model.config import load_config
    from model.weights import experts_nvfp4

    config = json.loads((SHIPPED_MODEL / "config.json").read_text())
    config.pop("quantization_config", None)
    config["text_config"].pop("quantization_config", None)
    folder = broken_checkpoint(tmp_path / "bf16", json.dumps(config))
    assert not experts_nvfp4(folder, load_config(folder), "auto")
    assert experts_nvfp4(folder, load_config(folder), "dummy")


@pytest.mark.parametrize(("environ", "built"), [({}, [0, 1]), ({"WORLD_SIZE": "2", "RANK": "1"}, [1])])
def test_the_split_check_builds_the_halves_this_process_stands_for(monkeypatch, environ, built):
    """The launcher checks every rank's half before starting them; a rank process (under torchrun or the launcher)
    checks only its own, which it then loads."""
    import model.flashnext
    from server.cli import start_refusal

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    ranks: list[int] = []
    real = model.flashnext.FlashNextModel

    def counting(cfg, tp):
        ranks.append(tp.rank)
        return real(cfg, tp=tp)

    monkeypatch.setattr(model.flashnext, "FlashNextModel", counting)
    args = build_parser().parse_args(["serve", str(SHIPPED_MODEL), "--tp", "2"])
    assert start_refusal(args) is None and ranks == built


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_a_gpu_is_refused_by_flag(capsys):
    assert main(["serve", "--device", "cuda"]) == 2
    assert "--device cuda: no CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("config", "message"),
    [("{not json", "is not valid JSON"), ("{}", "model_type"), (None, "no *.safetensors files")],
)
def test_a_broken_checkpoint_is_refused_in_one_line(tmp_path, capsys, config, message):
    """The message names what is wrong, with no traceback (a config the loader reads, weights it cannot find)."""
    text = config if config is not None else (SHIPPED_MODEL / "config.json").read_text()
    folder = broken_checkpoint(tmp_path / "broken", text)
    assert main(["serve", str(folder), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("raw", [b"\xff\xfe{}", b"[1, 2]"])
def test_a_config_json_that_is_not_a_json_object_is_refused_naming_the_file(tmp_path, capsys, raw):
    """Bytes that are not UTF-8 were refused as "'utf-8' codec can't decode byte 0xff", and a JSON list as "config
    must be a JSON object", neither naming the file."""
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "config.json").write_bytes(raw)
    assert main(["serve", str(folder), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert str(folder / "config.json") in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("tokenizer.json", "{not json", "tokenizer does not load"),
        ("generation_config.json", "{not json", "generation_config.json: not valid JSON"),
        ("generation_config.json", '{"eos_token_id": "</s>"}', "generation_config.json: eos_token_id must be"),
    ],
)
def test_a_broken_tokenizer_or_generation_config_is_refused_before_the_model_loads(
    tmp_path, capsys, monkeypatch, name, text, message
):
    """They were read after the weights, and failed with a traceback naming no file."""
    import server.serve

    folder = broken_checkpoint(tmp_path / "broken", (SHIPPED_MODEL / "config.json").read_text())
    (folder / name).write_text(text)
    monkeypatch.setattr(server.serve, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    assert main(["serve", str(folder), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_chat_template_with_a_syntax_error_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """It was found only at the first chat request, each answered 400 blaming the request's messages."""
    import server.serve

    folder = broken_checkpoint(tmp_path / "broken", (SHIPPED_MODEL / "config.json").read_text())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SHIPPED_MODEL / name, folder / name)
    (folder / "chat_template.jinja").write_text("{% if %}")
    monkeypatch.setattr(server.serve, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    assert main(["serve", str(folder), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert f"{folder}: its chat template does not compile" in err and "Traceback" not in err


def test_the_start_log_gives_the_address_with_the_port_bound(tmp_path):
    """--port 0 binds a free port, which the log line says, so a client can find it."""
    proc = spawn_server("--port", "0", "--api-key", "k")
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True).start()
    try:
        deadline, line = time.monotonic() + 60, ""
        while "listening on" not in line:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))  # queue.Empty: no such line in time
        address = line.split("listening on ")[1].split()[0]
        assert "(API key required)" in line and address.startswith("http://127.0.0.1:")
        assert int(address.rsplit(":", 1)[1]) > 0
    finally:
        stop([proc])


@pytest.mark.parametrize(("name", "field"), [("FLASHNEXT_ROUND_TRACE", "round_trace"),
                                             ("FLASHNEXT_ROUND_DIGESTS", "round_digests")])  # fmt: skip
def test_a_trace_or_digest_folder_that_cannot_take_the_rank_files_is_refused_by_name(tmp_path, name, field):
    """Each rank opens its file there at its first round, not at start: a missing folder passed, then ended the
    engine's thread at the first round (the request hung) or failed every request with a 500."""
    assert getattr(read_environment({name: str(tmp_path)}), field) == str(tmp_path)
    (tmp_path / "a_file").touch()
    for value in (str(tmp_path / "missing"), str(tmp_path / "a_file"), ""):
        with pytest.raises(ValueError, match=f"{name}: malformed value {value!r} .*folder"):
            read_environment({name: value})


def test_an_empty_api_key_in_the_environment_is_refused_by_name():
    """FLASHNEXT_API_KEY="" would silently serve without authentication."""
    assert read_environment({"FLASHNEXT_API_KEY": "sesame"}).api_key == "sesame"
    with pytest.raises(ValueError, match=r"FLASHNEXT_API_KEY: malformed value '' .*empty key"):
        read_environment({"FLASHNEXT_API_KEY": ""})


@pytest.mark.parametrize("value", ["429496.8", "MAX"])
def test_no_tp_timeout_allowed_ends_the_link_accept_early(value):
    """Rank 0 waits ten times the setting for rank 1 to connect, in a socket timeout that poll(2) takes as int
    milliseconds: 429496.8 s was allowed, wrapped around to 0.7 s, and rank 0 gave up on rank 1 at once."""
    from rankwire.link import ControlLink
    from server.settings import MAX_TIMEOUT_S

    text = str(MAX_TIMEOUT_S) if value == "MAX" else value
    try:
        seconds = read_environment({"FLASHNEXT_TP_TIMEOUT_S": text}).tp_timeout_s
    except ValueError as exc:
        assert "FLASHNEXT_TP_TIMEOUT_S" in str(exc)
        return
    listener = ControlLink.listen("127.0.0.1", 0)
    outcome = queue.Queue()
    waiter = threading.Thread(target=lambda: outcome.put(listener.accept(timeout=seconds * 10)))
    waiter.start()
    waiter.join(2.0)
    early = not waiter.is_alive()
    if not early:
        with socket.create_connection(("127.0.0.1", listener.port)):
            waiter.join(10)
        outcome.get_nowait().close()
    assert not early, "the accept ended before any rank 1 connected"


def test_an_engine_that_fails_between_rounds_ends_the_request_and_the_server_exits(tmp_path):
    """At --tp 1 too: the trace folder removed while serving fails the engine's first trace write; the engine's
    thread died there, the request hung and the server kept answering /health. Now the request gets an error and
    the process exits 1, so a supervisor can restart it."""
    trace = tmp_path / "trace"
    trace.mkdir()
    port = free_port()
    proc = spawn_server("--port", str(port), FLASHNEXT_ROUND_TRACE=str(trace))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, [proc])
        trace.rmdir()
        body = {"prompt": [5, 9, 14], "max_tokens": 32, "ignore_eos": True}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 500 and "the engine failed" in response.json()["error"]["message"]
        assert proc.wait(timeout=30) == 1
    finally:
        stop([proc])


QUANT_MIXED = {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION"}
QUANT_EXPERTS = "model.language_model.layers.0.mlp.experts"


@pytest.mark.parametrize(
    ("where", "quantization"),
    [
        ("config.json", {"quant_method": "modelopt", "quant_algo": ["FP8"]}),
        ("config.json", {**QUANT_MIXED, "quantized_layers": {QUANT_EXPERTS: {"quant_algo": ["NVFP4"]}}}),
        ("config.json", {**QUANT_MIXED, "quantized_layers": {QUANT_EXPERTS: {"quant_algo": {"x": 1}}}}),
        ("hf_quant_config.json", {"quant_method": "modelopt", "quant_algo": ["NVFP4"]}),
    ],
)
def test_a_quant_algo_that_is_no_string_is_refused_naming_it(tmp_path, capsys, monkeypatch, where, quantization):
    """A quant_algo that is a list or an object raised TypeError (unhashable) from the quant plan: a traceback, exit
    1."""
    import server.serve

    folder = tmp_path / "odd"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(SHIPPED_MODEL / name, folder / name)
    config = json.loads((SHIPPED_MODEL / "config.json").read_text())
    if where == "config.json":
        config["quantization_config"] = quantization
    else:
        config.pop("quantization_config", None)
        (folder / "hf_quant_config.json").write_text(json.dumps({"quantization": quantization}))
    (folder / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(server.serve, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    assert main(["serve", str(folder), "--host", "127.0.0.1", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "quant_algo" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_chat_template_that_is_no_text_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """A tokenizer_config.json chat_template that is a number loaded as "no template", and every chat request was
    then answered 400 blaming its messages."""
    import server.serve

    folder = tmp_path / "odd"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "generation_config.json"):
        shutil.copy(SHIPPED_MODEL / name, folder / name)
    tokenizer_config = json.loads((SHIPPED_MODEL / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = 5
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    monkeypatch.setattr(server.serve, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    assert main(["serve", str(folder), "--host", "127.0.0.1", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert str(folder) in err and "chat template" in err and "Traceback" not in err


@pytest.mark.parametrize("text", ["{not json", "[1]"])
def test_a_named_folders_broken_generation_config_is_refused_naming_its_path(tmp_path, capsys, monkeypatch, text):
    """`--generation-config FOLDER` with a broken file was refused as "generation_config.json: ...", which reads as
    the model's own (valid) file."""
    import server.serve

    folder = tmp_path / "defaults"
    folder.mkdir()
    (folder / "generation_config.json").write_text(text)
    monkeypatch.setattr(server.serve, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    assert main(["serve", "--generation-config", str(folder), "--host", "127.0.0.1", "--port", "0"]) == 2
    assert str(folder / "generation_config.json") in capsys.readouterr().err
