"""The `flashnext` command: `serve` (the OpenAI-compatible server) and `generate` (offline, one prompt)."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from model.shipped import SHIPPED_MODEL
from server.http_options import add_http_flags, api_key_refusal, http_options
from server.vllm_flags import ServeParser, add_vllm_flags

FRONTENDS = ("process", "thread")  # where the HTTP front end runs (server/frontend.py)
T = TypeVar("T")
MAX_LANES = 65535  # rankwire/codec.py packs a lane's slot as an unsigned 16-bit number


def _parsed(text: str, parse: Callable[[str], T], expected: str) -> T:
    """`parse(text)`, or the parser's error saying what was expected."""
    try:
        return parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from exc


def _positive_int(text: str) -> int:
    value = _parsed(text, int, "a whole number >= 1")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _lanes(text: str) -> int:
    value = _positive_int(text)
    if value > MAX_LANES:
        raise argparse.ArgumentTypeError(f"at most {MAX_LANES} (the control link sends lane slots as 16-bit numbers)")
    return value


def _port(text: str) -> int:
    value = _parsed(text, int, "a TCP port number")
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535] (0: any free port), got {value}")
    return value


def _gib(text: str) -> float:
    value = _parsed(text, float, "a number of GiB")
    if not math.isfinite(value) or value < 0 or not math.isfinite(value * 2**30):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def _temperature(text: str) -> float:
    value = _parsed(text, float, "a number")
    if not 0 <= value <= 100:
        raise argparse.ArgumentTypeError(f"must be in [0, 100], got {value}")
    return value


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from exc
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative token ids, got {text!r}")
    return ids


def _api_key(text: str) -> str:
    refusal = api_key_refusal(text)
    if refusal is not None:
        raise argparse.ArgumentTypeError(refusal)
    return text


def _seed(text: str) -> int:
    value = _parsed(text, int, "a whole number")
    if not -(2**63) <= value < 2**63:
        raise argparse.ArgumentTypeError(f"must be in [-2**63, 2**63), as the API's seed, got {value}")
    return value


class Spelled(argparse.Action):
    """A flag of several spellings (this server's and vLLM's): each value stored, and the spelling that gave it kept
    in `given_spellings` so that two spellings with different values can be refused naming both."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        spellings = namespace.__dict__.setdefault("given_spellings", {})
        spellings.setdefault(self.dest, {})[option_string] = values
        setattr(namespace, self.dest, values)


def _chat_template(value: str) -> str | None:
    """--chat-template: a file's text, or the template itself where the value names no file; either must look like
    a Jinja template (a tag or an expression). An empty value is none, as vLLM reads it: the checkpoint's."""
    if not value:
        return None
    path = Path(value)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{value!r} is a folder, not a template file")
    text, what = value, f"no file {value!r}, nor a Jinja template's text"
    if path.is_file():
        try:
            text, what = path.read_text(encoding="utf-8"), f"{value!r} holds no Jinja template"
        except (OSError, UnicodeDecodeError) as exc:
            raise argparse.ArgumentTypeError(f"{value!r} cannot be read as UTF-8 text ({exc})") from exc
    if not any(mark in text for mark in ("{%", "{{")):
        raise argparse.ArgumentTypeError(what)
    return text


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """Flags every command that loads a model shares."""
    parser.add_argument(
        "model",
        nargs="?",
        type=Path,
        default=SHIPPED_MODEL,
        help="checkpoint folder (default: the small model that ships with flashnext)",
    )
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="a folder whose tokenizer (with its chat template) to use in place of the checkpoint's, e.g. a config "
        "served with --load-format dummy; its ids must fit the model's vocab_size (default: the checkpoint's)",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to run (default cpu)")
    parser.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="compute dtype; auto is float32 on cpu and the checkpoint's dtype on cuda (default auto)",
    )
    parser.add_argument(
        "--kernels",
        choices=("auto", "on", "off"),
        default="auto",
        help="run each round's rows together through the Triton kernels (needs bfloat16); auto is on for cuda and "
        "off for cpu, where the reference forward runs (default auto)",
    )


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """The serve command's flags (also `python -m server`)."""
    add_model_flags(parser)
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    parser.add_argument("--port", type=_port, default=8000, help="HTTP port; 0 picks a free one (default 8000)")
    parser.add_argument(
        "--context",
        "--max-model-len",
        type=_positive_int,
        action=Spelled,
        default=None,
        help="tokens per request, prompt and output (default: the model's max_position_embeddings, lowered with a "
        "log line where it does not fit in memory: on the kernel path, until --max-lanes lanes of it fit in half the "
        "free memory; else where one lane does not fit)",
    )
    parser.add_argument(
        "--max-lanes",
        "--max-num-seqs",
        type=_lanes,
        action=Spelled,
        default=64,
        help="requests served at once, one lane each; more wait (default 64)",
    )
    parser.add_argument(
        "--prompt-budget",
        "--max-num-batched-tokens",
        type=_positive_int,
        action=Spelled,
        default=1024,
        help="prompt tokens a round may fill, so live lanes keep decoding (default 1024)",
    )
    parser.add_argument(
        "--api-key",
        nargs="+",
        type=_api_key,
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' or 'x-api-key: KEY', any of the keys given, as vLLM's (default: "
        "$FLASHNEXT_API_KEY, else vLLM's $VLLM_API_KEY, else none)",
    )
    parser.add_argument(
        "--load-format",
        choices=("auto", "dummy"),
        default="auto",
        help="auto reads the checkpoint; dummy makes random weights of the config's real shapes and formats on the "
        "device, each rank only its half, for benchmarks (default auto)",
    )
    parser.add_argument(
        "--cuda-graphs",
        choices=("auto", "on", "off"),
        default="auto",
        help="replay every round (decode rows, prompt chunks, verify windows, MTP rows) from CUDA graphs captured "
        "at start per batch bucket; needs --kernels on, --device cuda and --ngram-table device (default auto: on "
        "when they hold)",
    )
    parser.add_argument(
        "--ngram-table",
        choices=("device", "host"),
        default="device",
        help="where the n-gram table lives: device (each GPU holds its ranks' heads) or host (pinned memory, rows "
        "gathered by id) for GPUs it does not fit on (default device)",
    )
    parser.add_argument(
        "--drafts",
        type=int,
        choices=range(0, 16),
        metavar="{0..15}",
        default=None,
        help="draft tokens verified per round and lane; 0 turns drafting off (default 3)",
    )
    parser.add_argument(
        "--plan-ahead",
        choices=("on", "off"),
        default="on",
        help="plan and launch the next round while the GPU runs one that drafts nothing, so the host's work between "
        "rounds hides behind the GPU's (the same tokens either way; off can be faster where the host's round "
        "outlasts the GPU's, as on the shipped small model; default on)",
    )
    parser.add_argument(
        "--drafter",
        choices=("copy", "mtp"),
        default=None,
        help="copy: the continuation of repeated text when there is one, else the MTP chain; mtp: the MTP chain "
        "only (default copy)",
    )
    parser.add_argument(
        "--prompt-cache-gib",
        type=_gib,
        default=None,
        help="memory for kept prompt states; 0 turns the prompt cache off (default: 1 GiB on cpu, a quarter of the "
        "free GPU memory after loading on cuda)",
    )
    parser.add_argument(
        "--prompt-cache-grid",
        type=_positive_int,
        default=512,
        help="a prompt pass keeps its state every this many tokens, besides message ends (default 512)",
    )
    parser.add_argument(
        "--tp",
        "--tensor-parallel-size",
        "-tp",
        type=int,
        action=Spelled,
        choices=(1, 2),
        default=None,
        help="tensor parallel ranks; 2 starts both ranks itself (default: WORLD_SIZE under torchrun, else 1)",
    )
    parser.add_argument(
        "--frontend",
        choices=FRONTENDS,
        default="process",
        help="where the HTTP front end (tokenizing, detokenizing, JSON and SSE) runs: process (its own, beside rank "
        "0's engine) or thread (in rank 0's engine process) (default process)",
    )
    parser.add_argument(
        "--scheduling-policy",
        choices=("fcfs", "priority"),
        default="fcfs",
        help="which waiting request a free lane takes: fcfs (first come, first served) or priority (the lowest "
        "request priority value first, then first come; a running request is never put back for it), as vLLM's; "
        "under fcfs a request's priority must be 0 (default fcfs)",
    )
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model's ids in the API: requests may name any, /v1/models lists each, and answers carry the first, "
        "as vLLM's (default: the checkpoint folder's name)",
    )
    parser.add_argument(
        "--generation-config",
        default="auto",
        metavar="{auto,vllm,FOLDER}",
        help="the sampling defaults (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens as the "
        "default max_tokens of chats; a text completion's is 16) a request's unset fields take, as vLLM's flag "
        "gives them: auto reads the model's "
        "generation_config.json, vllm none (the API's own defaults), a folder its generation_config.json, whose "
        "max_new_tokens also caps every request (default auto)",
    )
    parser.add_argument(
        "--override-generation-config",
        default=None,
        metavar="JSON",
        help="sampling defaults over --generation-config's, as a JSON object of those keys, e.g. "
        "'{\"temperature\": 0.6}'; a max_new_tokens here also caps every request (default: none)",
    )
    parser.add_argument(
        "--chat-template",
        type=_chat_template,
        default=None,
        help="a Jinja chat template (a file, or the template's text) in place of the checkpoint's (default: the "
        "checkpoint's)",
    )
    add_http_flags(parser)
    add_vllm_flags(parser)


def build_parser() -> argparse.ArgumentParser:
    parser = ServeParser(prog="flashnext", description="Flash Next inference server")
    commands = parser.add_subparsers(dest="command", required=True)
    add_serve_flags(commands.add_parser("serve", help="serve the OpenAI-compatible HTTP API"))
    gen = commands.add_parser("generate", help="generate from one prompt offline; the last stdout line is JSON")
    add_model_flags(gen)
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (tokenized with the checkpoint's tokenizer, no chat template)")
    prompt.add_argument("--prompt-ids", type=_token_ids, help="prompt as comma-separated token ids, e.g. 1,2,3")
    gen.add_argument("--max-tokens", type=_positive_int, default=16, help="tokens to generate at most (default 16)")
    gen.add_argument(
        "--temperature", type=_temperature, default=1.0, help="0 is greedy; below 0.01 is taken as 0.01 (default 1.0)"
    )
    gen.add_argument("--seed", type=_seed, help="sampling seed (default: a fresh random seed)")
    gen.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence tokens")
    return parser


def run_generate(args: argparse.Namespace) -> int:
    """Load, tokenize, generate, print one JSON line."""
    from model.weights import load_model
    from server.generate import GenerateParams, generate
    from server.protocol import floored_temperature, fresh_seed
    from server.tokenizer import eos_token_ids, load_tokenizer

    tokenizer = load_tokenizer(args.model, tokenizer_dir=args.tokenizer)
    prompt_ids = generate_prompt(args, tokenizer)
    if isinstance(prompt_ids, str):  # refused at start already, where main runs it
        print(prompt_ids, file=sys.stderr)
        return 2
    model = load_model(args.model, device=args.device, dtype=args.dtype, kernels=args.kernels)
    params = GenerateParams(
        max_tokens=args.max_tokens,
        temperature=floored_temperature(args.temperature),
        seed=args.seed if args.seed is not None else fresh_seed(),
        eos_ids=eos_token_ids(args.model, tokenizer, model.cfg.eos_token_id, model.cfg.vocab_size),
        ignore_eos=args.ignore_eos,
    )
    tokens = generate(model, prompt_ids, params)
    text = tokenizer.decode(tokens, skip_special_tokens=True) if tokenizer is not None else ""
    print(json.dumps({"token_ids": tokens, "text": text}))
    return 0


def generate_prompt(args: argparse.Namespace, tokenizer: Any | None) -> list[int] | str:
    """`generate`'s prompt ids, or why they cannot be generated from (naming the flag)."""
    if args.prompt is None:
        return args.prompt_ids
    if tokenizer is None:
        return f"--prompt: {args.model} has no tokenizer; pass --prompt-ids, or --tokenizer FOLDER"
    return tokenizer(args.prompt, add_special_tokens=False)["input_ids"] or "--prompt: gives no tokens"


def generate_refusal(args: argparse.Namespace, tokenizer: Any | None, vocab: int, positions: int) -> str | None:
    """Why `generate`'s prompt or --max-tokens cannot run on the model's config (None: they can)."""
    prompt_ids = generate_prompt(args, tokenizer)
    if isinstance(prompt_ids, str):
        return prompt_ids
    if max(prompt_ids) >= vocab:
        return f"--prompt-ids: ids must be in [0, {vocab}), got {prompt_ids}"
    if len(prompt_ids) + args.max_tokens > positions:
        return (f"--max-tokens: {args.max_tokens} after a prompt of {len(prompt_ids)} tokens exceeds the model's "
                f"{positions} positions")  # fmt: skip
    return None


def start_refusal(args: argparse.Namespace) -> str | None:
    """Why these flags cannot start, naming the flag, found before any model loads or device work (None: they can);
    a --kernels setting the model cannot run on, or an environment variable that does not parse, raises ValueError
    naming it, and a tokenizer or generation_config.json that does not load a TokenizerError naming the file."""
    import torch

    from model.config import load_config
    from model.weights import experts_nvfp4, resolve_dtype, resolve_kernels
    from server.settings import peer_sums_refusal, read_environment

    settings = read_environment(os.environ)  # the kernels read FLASHNEXT_PDL, _GLUON and _OVERLAP too

    if args.device == "cuda" and not torch.cuda.is_available():
        return "--device cuda: no CUDA device is available to this process (torch.cuda.is_available() is False)"
    from model.parallel import TensorParallel

    cfg = load_config(args.model)
    device = torch.device(args.device)
    kernels = resolve_kernels(args.kernels, device)
    from server.ranks import RankEnv, launches_ranks, rank_env

    env = rank_env(args.tp) if args.command == "serve" else RankEnv()
    world = env.world
    if args.command == "serve":
        refusal = peer_sums_refusal(settings, world, args)
        if refusal is not None:
            return refusal
    if getattr(args, "load_format", "auto") == "dummy":  # before a rank's half is built, even on no device
        from model.dummy import size_refusal

        refusal = size_refusal(cfg, world, device)
        if refusal is not None:
            return refusal
    if kernels:
        from model.kernel_path import check

        check(cfg, resolve_dtype(args.dtype, cfg, device), device, TensorParallel(env.rank, world))
    # a rank process checks only its own half; the launcher, which starts them all, checks each
    ranks = range(world) if launches_ranks(env) else (env.rank,)
    if world > 1:  # a rank's half of every layer, on no device: a config that does not split is refused now
        from model.flashnext import FlashNextModel

        with torch.device("meta"):
            for rank in ranks:
                try:
                    FlashNextModel(cfg, tp=TensorParallel(rank, world))
                except ValueError as exc:
                    return f"--tp {world}: {exc}"
    if experts_nvfp4(args.model, cfg, getattr(args, "load_format", "auto")):
        from model.parallel import ShardPlan
        from model.quant import NVFP4_GROUP

        for rank in ranks:
            try:
                ShardPlan(cfg, TensorParallel(rank, world)).check_expert_blocks(NVFP4_GROUP)
            except ValueError as exc:
                return f"--tp {world}: {exc}" if world > 1 else str(exc)
    from server.tokenizer import check_vocab, eos_token_ids, load_tokenizer

    # read again once the weights are in; a --chat-template that does not compile is a TokenizerError naming it
    tokenizer = load_tokenizer(args.model, getattr(args, "chat_template", None), args.tokenizer)
    if args.tokenizer is not None:
        check_vocab(tokenizer, cfg.vocab_size)
    eos_token_ids(args.model, tokenizer, cfg.eos_token_id, cfg.vocab_size)
    if args.command == "generate":
        return generate_refusal(args, tokenizer, cfg.vocab_size, cfg.max_position_embeddings)
    if args.context is not None and args.context > cfg.max_position_embeddings:
        return f"--context: {args.context} exceeds the model's {cfg.max_position_embeddings} positions"
    from server.sampling_defaults import defaults_from_flags

    # a generation config out of the API's bounds raises ValueError naming the file or flag, and the key
    defaults_from_flags(args.model, args.generation_config, args.override_generation_config)
    http_options(args)  # a bad CORS list, root path or TLS file raises ValueError naming the flag
    for name in args.served_model_name or ():
        if not name.strip():
            return "--served-model-name: must not be empty"
    if args.cuda_graphs == "on":
        from server.serve import resolve_graphs

        resolve_graphs("on", kernels, args.device, args.ngram_table)
    return None


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    if not (args.model / "config.json").is_file():
        print(f"model: no config.json in {args.model}", file=sys.stderr)
        return 2
    try:
        refusal = start_refusal(args)
    except (ValueError, SystemExit) as exc:  # each names its field, flag or variable
        refusal = str(exc)
    if refusal is not None:
        print(refusal, file=sys.stderr)
        return 2
    from model.weights import CheckpointError

    try:
        if args.command == "serve":
            from server.serve import run_serve

            return run_serve(args, list(argv if argv is not None else sys.argv[1:])[1:])
        return run_generate(args)
    except CheckpointError as exc:
        print(f"model: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before serving began (loading): nothing to shut down
        return 130


if __name__ == "__main__":
    sys.exit(main())
