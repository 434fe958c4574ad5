"""vLLM's serve flags: a vLLM command line starts this server, each flag taken for the setting it means here, and a
flag that contradicts one of this server's own is refused naming both."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch

from model.shipped import SHIPPED_MODEL
from server import serve as serve_module
from server.cli import build_parser, main
from tests.server.live import serve, tiny_chat_checkpoint


def parsed(*flags: str):
    return build_parser().parse_args(["serve", *flags])


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ((), {"cuda_graphs": "auto", "prompt_cache_gib": None, "drafts": 3, "drafter": "copy", "prompt_budget": 1024}),
        (("--enforce-eager",), {"cuda_graphs": "off"}),
        (("--enforce-eager", "--cuda-graphs", "off"), {"cuda_graphs": "off"}),
        (("--no-enable-prefix-caching",), {"prompt_cache_gib": 0.0}),
        (("--enable-prefix-caching",), {"prompt_cache_gib": None}),
        (("--enable-prefix-caching", "--prompt-cache-gib", "2"), {"prompt_cache_gib": 2.0}),
        (("--speculative-config", '{"method": "qwen3_next_mtp", "num_speculative_tokens": 2}'), {"drafts": 2,
         "drafter": "mtp"}),
        (("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5}'), {"drafts": 5,
         "drafter": "copy"}),
        (("--speculative-config", '{"num_speculative_tokens": 1}'), {"drafts": 1, "drafter": "mtp"}),
        (("--speculative-config", '{"method": "qwen3_next_mtp"}'), {"drafts": 1, "drafter": "mtp"}),
        (("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5,'
          ' "prompt_lookup_min": 2}'), {"drafts": 4, "drafter": "copy"}),
        (("--drafts", "0"), {"drafts": 0, "drafter": "copy"}),
        (("--max-num-batched-tokens", "512"), {"prompt_budget": 512}),
        (("--gpu-memory-utilization", "0.85", "--device", "cuda"), {"gpu_memory_utilization": 0.85}),
    ],
)  # fmt: skip
def test_vllm_flags_are_taken_for_the_settings_they_mean_here(flags, expected):
    args = parsed(*flags)
    assert {name: getattr(args, name) for name in expected} == expected


def test_both_ranks_agree_on_the_utilization():
    from server.serve import canonical_settings
    from server.settings import EnvSettings

    shares = [canonical_settings(parsed("--device", "cuda", *f), 2, EnvSettings())["gpu_memory_utilization"]
              for f in ((), ("--gpu-memory-utilization", "0.8"))]  # fmt: skip
    assert shares == ["all free", 0.8]


def test_vllms_flags_that_change_nothing_here_are_taken():
    args = parsed("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "deepseek_r1",
                  "--trust-remote-code", "--disable-log-requests", "--disable-log-stats", "--data-parallel-size", "1",
                  "--pipeline-parallel-size", "1", "--enable-expert-parallel", "--kv-cache-dtype", "auto",
                  "--enable-prompt-tokens-details", "--enable-chunked-prefill", "--async-scheduling")  # fmt: skip
    assert (args.tool_call_parser, args.reasoning_parser, args.trust_remote_code) == ("hermes", "deepseek_r1", True)
    assert args.disable_log_requests and args.disable_log_stats and args.enable_expert_parallel
    assert (args.plan_ahead, args.kv_cache_dtype) == ("on", "auto")


def test_vllms_short_parallel_flags_are_taken():
    args = parsed("-tp", "2", "-dp", "1", "-pp", "1")
    assert (args.tp, args.data_parallel_size, args.pipeline_parallel_size) == (2, 1, 1)


def test_the_checkpoint_may_come_as_vllms_older_model_flag():
    assert parsed("--model", "configs/tiny").model == Path("configs/tiny")
    assert parsed().model == SHIPPED_MODEL


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (("--enforce-eager", "--cuda-graphs", "on"), "--enforce-eager: contradicts --cuda-graphs on"),
        (("--no-enable-prefix-caching", "--prompt-cache-gib", "1"), "--no-enable-prefix-caching: contradicts "
         "--prompt-cache-gib 1"),
        (("--enable-prefix-caching", "--prompt-cache-gib", "0"), "--enable-prefix-caching: contradicts "
         "--prompt-cache-gib 0"),
        (("--speculative-config", '{"num_speculative_tokens": 2}', "--drafts", "2"), "--speculative-config: give it "
         "or --drafts and --drafter, not both"),
        (("--speculative-config", '{"num_speculative_tokens": 2}', "--drafter", "mtp"), "not both"),
        (("--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}'), "method 'eagle' is not one of "
         "mtp, qwen3_next_mtp, ngram"),
        (("--speculative-config", '{"method": "ngram"}'), "num_speculative_tokens must be an integer in [1, 15]"),
        (("--speculative-config", '{"method": "mtp", "prompt_lookup_max": 4}'), "'prompt_lookup_max' is not taken "
         "with method 'mtp'"),
        (("--speculative-config", '{"num_speculative_tokens": 16}'), "num_speculative_tokens must be an integer"),
        (("--speculative-config", '{"num_speculative_tokens": 2, "model": "x"}'), "'model' is not taken"),
        (("--speculative-config", "[2]"), "--speculative-config: expected a JSON object, got list"),
        (("--speculative-config", "{"), "--speculative-config: not valid JSON"),
        (("--gpu-memory-utilization", "0.5"), "--gpu-memory-utilization: needs --device cuda"),
        (("--gpu-memory-utilization", "0", "--device", "cuda"), "--gpu-memory-utilization: expected a number in "
         "(0, 1], got '0'"),
        (("--gpu-memory-utilization", "1.5", "--device", "cuda"), "expected a number in (0, 1], got '1.5'"),
        (("--tool-call-parser", "mistral"), "--tool-call-parser: invalid choice: 'mistral'"),
        (("--reasoning-parser", "gpt_oss"), "--reasoning-parser: invalid choice: 'gpt_oss'"),
        (("configs/tiny", "--model", "configs/tiny"), "--model: give the checkpoint once, as MODEL (configs/tiny)"),
        (("--data-parallel-size", "2"), "--data-parallel-size 2: only --tensor-parallel-size splits the model"),
        (("--pipeline-parallel-size", "2"), "--pipeline-parallel-size 2: only --tensor-parallel-size"),
        (("--kv-cache-dtype", "fp8"), "--kv-cache-dtype: invalid choice: 'fp8'"),
        (("--async-scheduling", "--plan-ahead", "off"), "--async-scheduling: contradicts --plan-ahead off"),
        (("--served-model-name", "x", "configs/qwen3.8-flash-next"), "--served-model-name: "
         "'configs/qwen3.8-flash-next' is a checkpoint folder"),
    ],
)  # fmt: skip
def test_contradicting_or_malformed_vllm_flags_are_refused_naming_them(capsys, flags, named):
    with pytest.raises(SystemExit) as exit_info:
        parsed(*flags)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert named in err and err.startswith("usage: flashnext serve")


def test_a_utilization_bounds_this_ranks_own_use_as_vllms_per_instance_limit(monkeypatch):
    gib = 2**30
    free = [60 * gib]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free[0], 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 2 * gib)  # this rank's weights
    cuda = torch.device("cuda", 0)
    assert serve_module.free_memory(cuda) == 60 * gib
    assert serve_module.free_memory(cuda, 0.5) == 38 * gib  # 40 GiB allowed, 2 held
    assert serve_module.free_memory(cuda, 0.9) == 60 * gib  # 70 GiB allowed: what is free is the bound
    free[0] = 42 * gib  # another process holds 36 GiB: it limits this one only through what is free
    assert serve_module.free_memory(cuda, 0.45) == 34 * gib
    assert serve_module.free_memory(cuda, 0.02) == 0  # the weights alone are past the share
    model = SimpleNamespace(cfg=SimpleNamespace(max_position_embeddings=4096), device=cuda)
    args = SimpleNamespace(context=None, gpu_memory_utilization=0.02)
    with pytest.raises(SystemExit, match=r"--gpu-memory-utilization 0\.02: this rank holds 2\.0 GiB once its weights"):
        serve_module.plan_lanes(args, model)
    with pytest.raises(SystemExit, match=r"of the 0\.0 GiB that --gpu-memory-utilization 0\.3 leaves; lower --context"):
        serve_module.pool_context(
            None, 4096, lambda n: n * 4096, 64, 40 * 2**20, "that --gpu-memory-utilization 0.3 leaves"
        )


def test_a_vllm_command_line_serves_and_its_drafts_keep_drafted_equal_to_undrafted(tmp_path):
    model = tiny_chat_checkpoint(tmp_path / "tiny")
    vllm_flags = ["--enforce-eager", "--enable-prefix-caching", "--enable-auto-tool-choice", "--tool-call-parser",
                  "hermes", "--reasoning-parser", "qwen3", "--trust-remote-code", "--max-num-batched-tokens", "256",
                  "--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 2})]  # fmt: skip
    with serve(model, *vllm_flags) as live:
        body = {"prompt": "ab ab ab ab ab", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        answers = [httpx.post(f"{live.v1}/completions", json={**body, "draft": d}, timeout=120) for d in (True, False)]
        assert [a.status_code for a in answers] == [200, 200], answers[0].text
        assert answers[0].json()["token_sha"] == answers[1].json()["token_sha"]


def test_serve_refuses_a_utilization_on_the_cpu_before_the_model_loads(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--gpu-memory-utilization", "0.9"])
    assert exit_info.value.code == 2
    assert "--gpu-memory-utilization: needs --device cuda" in capsys.readouterr().err
