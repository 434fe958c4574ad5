"""FLASHNEXT_* settings from the environment, validated by name before any device work."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kernels import FORCE_NO_FP_FUSION_ENV, FP_FUSION_ENV
from model.side_stream import SITES, parse_sites
from server.http_options import api_key_refusal

TRITON_TRUE = ("1", "true", "on", "yes", "y")  # how Triton reads a true boolean variable: these, in any case


def _port(text: str) -> int:
    value = int(text)
    if not 0 < value < 65536:
        raise ValueError(f"{value} is not a TCP port")
    return value


# the longest timeout every wait it reaches can take: the link's accept and connect wait ten times it, in socket
# timeouts that poll(2) takes as milliseconds in a C int (a longer one wraps around, to as little as no time)
MAX_TIMEOUT_S = (2**31 - 1) // 1000 // 10


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 < value <= MAX_TIMEOUT_S:  # NaN fails too
        raise ValueError(f"{value} is not a number of seconds above 0 and at most {MAX_TIMEOUT_S}")
    return value


def _switch(text: str) -> bool:
    if text not in ("0", "1"):
        raise ValueError("expected 0 or 1")
    return text == "1"


VLLM_API_KEY = "VLLM_API_KEY"  # vLLM's variable for the API key, read as vLLM reads it


def _key(text: str) -> str:
    refusal = api_key_refusal(text)
    if refusal is not None:
        raise ValueError(refusal)
    return text


def _folder(text: str) -> str:
    if not text or not os.path.isdir(text):
        raise ValueError("not an existing folder; each rank writes its file into it")
    if not os.access(text, os.W_OK | os.X_OK):
        raise ValueError("a folder this process cannot write files in")
    return text


def _lanes(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"{value} is not a positive number of lanes")
    return value


KNOWN: dict[str, tuple[Callable[[str], object], str]] = {
    "FLASHNEXT_API_KEY": (_key, "the API key, as --api-key"),
    "FLASHNEXT_LINK_PORT": (_port, "the control link's port on rank 0 (default: MASTER_PORT + 1)"),
    "FLASHNEXT_TP_TIMEOUT_S": (_seconds, "seconds a collective may take before the ranks give up (default 60)"),
    "FLASHNEXT_ROUND_DIGESTS": (_folder, "a folder where each rank writes a digest of every round's logits and tokens"),
    "FLASHNEXT_ROUND_TRACE": (_folder, "a folder where each rank writes every round's phase timings (JSON lines)"),
    "FLASHNEXT_PDL": (_switch, "0 turns off programmatic dependent launch of the Triton kernels (kernels/pdl.py)"),
    "FLASHNEXT_PDL_PREFETCH": (_switch, "0 keeps PDL but drops the linear kernel's weight prefetch (kernels/pdl.py)"),
    "FLASHNEXT_GLUON": (_switch, "0 runs the MoE's Triton gate-up and down, not its Gluon ones (kernels/moe_gluon.py)"),
    "FLASHNEXT_OVERLAP": (
        parse_sites,
        f"the kernel path's sites that fork work onto the side stream: 1 (default), 0, or some of {','.join(SITES)}",
    ),
    "FLASHNEXT_PEER_SUMS": (
        _switch,
        "1 sums the two ranks' partials inside the next hyper write over NVLink, not by NCCL's all-reduce (--tp 2 "
        "on --device cuda with the kernels on; model/peer_sums.py)",
    ),
    "FLASHNEXT_ROUND_PROFILE": (
        _lanes,
        "with FLASHNEXT_ROUND_TRACE: the kernel table (rank{r}.profile.txt) of 5 rounds after one of this many lanes",
    ),
    "FLASHNEXT_ROUND_PYPROFILE": (
        _lanes,
        "with FLASHNEXT_ROUND_TRACE: Python's profile of the round's thread (rank{r}.pyprofile.txt) over 20 rounds "
        "after one of this many lanes",
    ),
}


@dataclass(frozen=True, slots=True)
class EnvSettings:
    """The parsed FLASHNEXT_* settings."""

    api_key: str | None = None
    link_port: int | None = None
    tp_timeout_s: float = 60.0
    round_digests: str | None = None
    round_trace: str | None = None
    round_profile: int | None = None
    round_pyprofile: int | None = None
    peer_sums: bool = False


def check_fp_fusion(environ: Mapping[str, str]) -> None:
    """Refuse, by name, a Triton setting that compiles the kernels without fused multiply-adds (`kernels`' pin)."""
    default = environ.get(FP_FUSION_ENV)
    if default is not None and default.lower() not in TRITON_TRUE:
        raise ValueError(f"{FP_FUSION_ENV}={default!r} turns off the fused multiply-adds the kernels' bits were "
                         "checked with; unset it or set it to 1")  # fmt: skip
    if environ.get(FORCE_NO_FP_FUSION_ENV, "").lower() in TRITON_TRUE:
        raise ValueError(f"{FORCE_NO_FP_FUSION_ENV} turns off the fused multiply-adds the kernels' bits were checked "
                         "with; unset it")  # fmt: skip


def read_environment(environ: Mapping[str, str]) -> EnvSettings:
    """Parse every FLASHNEXT_* variable, and vLLM's VLLM_API_KEY (the API key where FLASHNEXT_API_KEY is unset, as
    vLLM takes it); an unknown name or a malformed value is refused by name, as is a Triton setting that turns off
    fused multiply-adds."""
    check_fp_fusion(environ)
    values: dict[str, object] = {}
    for name, text in environ.items():
        if not name.startswith("FLASHNEXT_"):
            continue
        if name not in KNOWN:
            raise ValueError(f"{name}: unknown setting; known ones are {', '.join(sorted(KNOWN))}")
        parse, _ = KNOWN[name]
        try:
            values[name] = parse(text)
        except ValueError as exc:
            raise ValueError(f"{name}: malformed value {text!r} ({exc})") from exc
    vllm_key = environ.get(VLLM_API_KEY)
    if vllm_key is not None:
        try:
            vllm_key = _key(vllm_key)
        except ValueError as exc:
            raise ValueError(f"{VLLM_API_KEY}: malformed value ({exc})") from exc
    return EnvSettings(
        api_key=values.get("FLASHNEXT_API_KEY", vllm_key),
        link_port=values.get("FLASHNEXT_LINK_PORT"),
        tp_timeout_s=values.get("FLASHNEXT_TP_TIMEOUT_S", 60.0),
        round_digests=values.get("FLASHNEXT_ROUND_DIGESTS"),
        round_trace=values.get("FLASHNEXT_ROUND_TRACE"),
        round_profile=values.get("FLASHNEXT_ROUND_PROFILE"),
        round_pyprofile=values.get("FLASHNEXT_ROUND_PYPROFILE"),
        peer_sums=values.get("FLASHNEXT_PEER_SUMS", False),
    )


def peer_sums_refusal(env: EnvSettings, world: int, args: argparse.Namespace) -> str | None:
    """Why FLASHNEXT_PEER_SUMS=1 cannot run with these flags (None: it can, or it is not asked for)."""
    if env.peer_sums and (world != 2 or args.device != "cuda" or args.kernels == "off"):
        return "FLASHNEXT_PEER_SUMS=1: peer sums need --tp 2, --device cuda and the kernels on (--kernels auto or on)"
    return None
