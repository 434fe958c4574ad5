"""vLLM's `serve` flags that a vLLM command line brings: their parser entries, and their translation into this
server's own settings, refused naming both flags where the two contradict each other."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from model.shipped import SHIPPED_MODEL
from server.tool_calls import TOOL_CALL_PARSERS

DRAFTS_DEFAULT, DRAFTER_DEFAULT = 3, "copy"  # --drafts and --drafter when neither they nor a speculative config say
# vLLM's speculative methods this server has a drafter for: the MTP layer's chain, and prompt lookup (the copy
# drafter proposes the continuation of text seen before, and the MTP chain where there is none)
SPECULATIVE_METHODS = {"mtp": "mtp", "qwen3_next_mtp": "mtp", "ngram": "copy"}
# prompt lookup's match lengths: taken with ngram and not used (the copy drafter matches by its own rule)
NGRAM_KEYS = {"prompt_lookup_min", "prompt_lookup_max"}
MAX_DRAFTS = 15


def _utilization(text: str) -> float:
    """A share of the GPU's memory in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's flags, in a group of their own in --help."""
    group = parser.add_argument_group("vLLM's flags", "taken for this server's settings where they mean the same")
    group.add_argument(
        "--gpu-memory-utilization",
        type=_utilization,
        default=None,
        help="the share of each GPU's memory a rank may use, its weights included (what its PyTorch allocator holds; "
        "other processes count only through what is free): the lane pool and the prompt cache are sized from what "
        "that leaves, not from all that is free (needs --device cuda; default: all free)",
    )
    group.add_argument("--enforce-eager", action="store_true", help="the same as --cuda-graphs off (default: off)")
    group.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the prompt cache on (the default) or off: --no-enable-prefix-caching is --prompt-cache-gib 0",
    )
    group.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='in place of --drafts and --drafter: {"method": "mtp" (or "qwen3_next_mtp": the MTP chain, 1 draft '
        'unless told) or "ngram" (the copy drafter; its prompt_lookup_min/max are taken and unused), '
        '"num_speculative_tokens": N} (default: none)',
    )
    group.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='taken: tool_choice "auto" is served either way (default: off)',
    )
    group.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default="auto",
        help="how a <tool_call> block is read: hermes (a JSON object) or qwen3_coder (<function=NAME> with "
        "<parameter=KEY> values, the real Flash Next model's form); auto picks qwen3_coder where the chat template "
        "writes calls that way, else hermes (default auto)",
    )
    group.add_argument(
        "--reasoning-parser",
        choices=("qwen3", "deepseek_r1"),
        default=None,
        help="taken: text in a think block, opened by the template or the model, is reasoning_content",
    )
    group.add_argument(
        "--trust-remote-code", action="store_true", help="taken: no checkpoint code is ever run (default: off)"
    )
    group.add_argument(
        "--disable-log-requests", action="store_true", help="taken: no request is logged either way (default: off)"
    )
    group.add_argument(
        "--model",
        dest="model_flag",
        type=Path,
        default=None,
        help="the checkpoint folder, in place of MODEL (vLLM's older spelling) (default: MODEL)",
    )
    for name in ("data", "pipeline"):
        group.add_argument(
            f"--{name}-parallel-size",
            f"-{name[0]}p",
            type=int,
            default=1,
            help="taken at 1: one replica, split only by --tensor-parallel-size (default 1)",
        )
    group.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="taken: each rank holds its share of every expert's columns, as tensor parallelism splits them "
        "(default: off)",
    )
    group.add_argument(
        "--kv-cache-dtype",
        choices=("auto",),
        default="auto",
        help="taken at auto: the QSA caches are kept in the model's dtype (no fp8 caches)",
    )
    group.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="taken: usage always carries prompt_tokens_details.cached_tokens (default: off)",
    )
    group.add_argument(
        "--enable-chunked-prefill",
        action="store_true",
        help="taken: prompts are always served in passes of --prompt-budget tokens beside the decoding lanes "
        "(default: off)",
    )
    group.add_argument(
        "--async-scheduling",
        action="store_true",
        help="taken: rounds are planned ahead already (--plan-ahead on, the default) (default: off)",
    )
    group.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="taken: no stats are logged either way; /metrics has them (default: off)",
    )


def json_object(flag: str, text: str) -> dict[str, Any]:
    """A flag's JSON object, refused naming the flag where the text is no JSON object."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{flag}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{flag}: expected a JSON object, got {type(data).__name__}")
    return data


def _speculative(text: str) -> tuple[str, int]:
    """(drafter, drafts) of a --speculative-config JSON object."""
    config = json_object("--speculative-config", text)
    method = config.get("method", "mtp")
    if not isinstance(method, str) or method not in SPECULATIVE_METHODS:
        raise ValueError(f"--speculative-config: method {method!r} is not one of {', '.join(SPECULATIVE_METHODS)}")
    taken = {"method", "num_speculative_tokens"} | (NGRAM_KEYS if method == "ngram" else set())
    unknown = sorted(set(config) - taken)
    if unknown:
        raise ValueError(f"--speculative-config: {unknown[0]!r} is not taken with method {method!r}")
    lookup = [config.get(key) for key in ("prompt_lookup_min", "prompt_lookup_max")]
    for key, value in zip(("prompt_lookup_min", "prompt_lookup_max"), lookup, strict=True):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"--speculative-config: {key} must be an integer >= 1, as vLLM's")
    if None not in lookup and lookup[0] > lookup[1]:
        raise ValueError("--speculative-config: prompt_lookup_min must not exceed prompt_lookup_max, as vLLM's")
    # vLLM's MTP drafts as many tokens as the model has MTP layers unless told: one here
    drafts = config.get("num_speculative_tokens", 1 if SPECULATIVE_METHODS[method] == "mtp" else None)
    if isinstance(drafts, bool) or not isinstance(drafts, int) or not 1 <= drafts <= MAX_DRAFTS:
        raise ValueError(f"--speculative-config: num_speculative_tokens must be an integer in [1, {MAX_DRAFTS}]")
    return SPECULATIVE_METHODS[method], drafts


def _checkpoint_among(names: list[str] | None) -> str | None:
    """The first of `names` that is a checkpoint folder (one with a config.json), if any."""
    return next((name for name in names or () if (Path(name) / "config.json").is_file()), None)


def apply_vllm_flags(args: argparse.Namespace) -> None:
    """Turn the vLLM flags given into this server's settings (and fill --drafts and --drafter); ValueError names
    both flags where they contradict each other."""
    for flag, values in (("--served-model-name", args.served_model_name), ("--api-key", args.api_key)):
        if args.model is SHIPPED_MODEL and (folder := _checkpoint_among(values)):  # MODEL was not given
            raise ValueError(
                f"{flag}: {folder!r} is a checkpoint folder, taken as a value (the values run to the next flag): "
                f"give MODEL before {flag}"
            )
    if args.model_flag is not None:
        if args.model is not SHIPPED_MODEL:  # the positional's default object: MODEL was not given
            raise ValueError(f"--model: give the checkpoint once, as MODEL ({args.model}) or as --model")
        args.model = args.model_flag
    for given in getattr(args, "given_spellings", {}).values():
        (first, a), *others = given.items()
        differing = [(flag, value) for flag, value in others if repr(value) != repr(a)]
        if differing:  # one setting under two names, with two values
            second, b = differing[0]
            raise ValueError(f"{first} {a} and {second} {b}: one setting under two names; give one")
    for flag, size in (("--data-parallel-size", args.data_parallel_size), ("--pipeline-parallel-size",
                       args.pipeline_parallel_size)):  # fmt: skip
        if size != 1:
            raise ValueError(f"{flag} {size}: only --tensor-parallel-size splits the model here; serve one replica")
    if args.async_scheduling and args.plan_ahead == "off":
        raise ValueError("--async-scheduling: contradicts --plan-ahead off; give one")
    if args.gpu_memory_utilization is not None and args.device != "cuda":
        raise ValueError(
            "--gpu-memory-utilization: needs --device cuda (it shares out a GPU's memory; this server runs on the CPU "
            "unless --device cuda is given)"
        )
    if args.enforce_eager:
        if args.cuda_graphs == "on":
            raise ValueError("--enforce-eager: contradicts --cuda-graphs on; give one")
        args.cuda_graphs = "off"
    if args.enable_prefix_caching is not None:
        cache_off = args.prompt_cache_gib == 0
        if args.prompt_cache_gib is not None and cache_off == args.enable_prefix_caching:
            flag = "--enable-prefix-caching" if args.enable_prefix_caching else "--no-enable-prefix-caching"
            raise ValueError(f"{flag}: contradicts --prompt-cache-gib {args.prompt_cache_gib:g}; give one")
        if not args.enable_prefix_caching:
            args.prompt_cache_gib = 0.0
    if args.speculative_config is not None:
        if args.drafts is not None or args.drafter is not None:
            raise ValueError("--speculative-config: give it or --drafts and --drafter, not both")
        args.drafter, args.drafts = _speculative(args.speculative_config)
    args.drafts = DRAFTS_DEFAULT if args.drafts is None else args.drafts
    args.drafter = DRAFTER_DEFAULT if args.drafter is None else args.drafter


class ServeParser(argparse.ArgumentParser):
    """The flashnext parser: a serve command's vLLM flags are taken into its own settings as it is parsed, and a
    contradiction is refused as any bad flag is (exit 2, naming the flags)."""

    def parse_known_args(self, args=None, namespace=None):
        """argparse's parse, then the vLLM flags' translation."""
        namespace, extras = super().parse_known_args(args, namespace)
        if getattr(namespace, "command", None) == "serve":
            try:
                apply_vllm_flags(namespace)
            except ValueError as exc:
                serve = next(action for action in self._actions if action.dest == "command").choices["serve"]
                serve.error(str(exc))  # with serve's usage line, as argparse's own refusals of its flags have
        return namespace, extras
