"""`flashnext serve`: settings, ranks, the model, the engine and the HTTP server (rank 0) or the follower (rank 1)."""

from __future__ import annotations

import argparse
import hashlib
import logging
import math
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from model.config import load_config
from model.parallel import TensorParallel
from model.state import slot_state_bytes
from model.weights import load_model, resolve_kernels
from rankwire.codec import VERSION as HEADER_VERSION
from rankwire.errors import SettingsMismatch
from rankwire.link import ControlLink
from server.app import ServerState
from server.drafters import DRAFTERS
from server.engine import Engine
from server.frontend import FrontendProcess, FrontSettings, http_server, listen_socket
from server.guides import Guides
from server.handle import LocalEngine
from server.http_options import http_options
from server.metrics import EngineMetrics
from server.prompt_cache import PromptCache
from server.protocol import SamplingDefaults
from server.ranks import (
    RankEnv,
    control_link_host,
    control_link_port,
    hold_signals_for_rank0,
    init_group,
    launch,
    launches_ranks,
    leave_group,
    rank_env,
)
from server.round_trace import RoundTrace
from server.runner import ModelRunner
from server.sampling_defaults import defaults_from_flags
from server.settings import EnvSettings, read_environment
from server.tokenizer import eos_token_ids, load_tokenizer
from server.tool_calls import tool_call_parser
from server.tp import LinkedRunner, follow, watch_peer

log = logging.getLogger(__name__)


def free_memory(device: torch.device, utilization: float | None = None) -> int:
    """Bytes free for lane state on `device`: on a GPU, with --gpu-memory-utilization, at most what keeps this
    process's own use (what its PyTorch allocator holds) within that share of the GPU, as vLLM's per-instance
    limit; other processes' use bounds it only through what is free."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        if utilization is None:
            return free
        return max(0, min(free, math.floor(utilization * total) - torch.cuda.memory_reserved(device)))
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def choose_context(requested: int | None, model_max: int, lane_bytes, free: int) -> int:
    """The model's maximum unless asked otherwise, lowered only if one lane of it cannot fit in memory."""
    context = requested or model_max
    if requested is None and lane_bytes(context) > 0.9 * free:
        while context > 256 and lane_bytes(context) > 0.9 * free:
            context //= 2
        log.warning("--context: one lane of %d tokens does not fit in free memory; serving %d", model_max, context)
    return context


POOL_SHARE = 0.5  # of the memory free after loading: the rest holds the prompt cache (a quarter) and activations
VERIFY_ROWS = 64  # rows of the largest verify graph: it keeps every row's GDN state (a MiB a row and layer at 2 ranks)


def pool_context(
    requested: int | None, model_max: int, slot_bytes, lanes: int, free: int, free_of: str = "free"
) -> int:
    """The context of every lane-pool slot: as asked (refused, naming the flags, if the pool would not fit), else the
    model's, or the longest multiple of 256 for which --max-lanes slots and the scratch slot fit in
    POOL_SHARE of the free memory (`free_of` says whose: the GPU's, or what a flag leaves)."""
    budget = POOL_SHARE * free
    fits = lambda n: (lanes + 1) * slot_bytes(n) <= budget  # noqa: E731
    context = requested or (model_max if fits(model_max) else None)
    if context is None:
        lo, hi = 0, model_max // 256  # in units of 256 positions: the longest that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(256 * mid) else (lo, mid - 1)
        context = max(256 * lo, min(256, model_max))
    if not fits(context):
        need = (lanes + 1) * slot_bytes(context)
        raise SystemExit(
            f"--context {context} with --max-lanes {lanes}: the lane pool needs {need / 2**30:.1f} GiB, more than "
            f"{POOL_SHARE:.0%} of the {free / 2**30:.1f} GiB {free_of}; lower --context or --max-lanes"
        )
    if requested is None and context < model_max:
        log.warning("--context: %d lanes of %d tokens do not fit; serving %d tokens a lane", lanes, model_max, context)
    return context


def resolve_graphs(name: str, kernels: bool, device: str | torch.device, ngram_table: str = "device") -> bool:
    """Whether rounds replay CUDA graphs: --cuda-graphs auto, on or off, refused without their needs (the kernel
    path on CUDA, and the n-gram table on the GPUs: a graph cannot gather rows from host memory)."""
    usable = kernels and torch.device(device).type == "cuda"
    if name == "on" and not usable:
        raise SystemExit("--cuda-graphs on: needs --kernels on and --device cuda")
    if name == "on" and ngram_table != "device":
        raise SystemExit(f"--cuda-graphs on: needs --ngram-table device, not {ngram_table}")
    return usable and name != "off" and ngram_table == "device"


def plan_lanes(args: argparse.Namespace, model) -> int:
    """The context per lane. On the kernel path also the lane pool (--max-lanes slots of that context, made now)
    and, with --cuda-graphs, the decode rounds captured for up to --max-lanes lanes; both are reported."""
    cfg = model.cfg
    if args.context is not None and args.context > cfg.max_position_embeddings:
        raise SystemExit(f"--context: {args.context} exceeds the model's {cfg.max_position_embeddings} positions")
    utilization = getattr(args, "gpu_memory_utilization", None)
    free = free_memory(model.device, utilization)
    free_of = "free" if utilization is None else f"that --gpu-memory-utilization {utilization:g} leaves"
    if utilization is not None and free == 0:
        unused, total = torch.cuda.mem_get_info(model.device)
        held = torch.cuda.memory_reserved(model.device)
        raise SystemExit(
            f"--gpu-memory-utilization {utilization:g}: this rank holds {held / 2**30:.1f} GiB once its weights are "
            f"in, and {unused / 2**30:.1f} of the GPU's {total / 2**30:.1f} GiB are free: nothing is left for the "
            "lanes within that share; raise it"
        )
    template = model.new_lane()
    slot_bytes = lambda n: slot_state_bytes(template, n, cfg.indexer_compress_ratio)  # noqa: E731
    if not model.kernels:
        return choose_context(args.context, cfg.max_position_embeddings, slot_bytes, free)
    from model import kernel_path

    context = pool_context(args.context, cfg.max_position_embeddings, slot_bytes, args.max_lanes, free, free_of)
    if model.tp.world > 1:  # every rank serves the shortest: a rank whose pool grew mid-serving would leave its graphs
        context = int(model.tp.gather(torch.tensor([context], device=model.device), dim=0).min())
    pool = kernel_path.lane_pool(model, slots=args.max_lanes, context=context)
    log.info("lane pool: %d slots of %d positions, %.2f GiB", pool.slots, pool.context, pool.nbytes() / 2**30)
    if resolve_graphs(args.cuda_graphs, model.kernels, model.device, args.ngram_table):
        started = time.monotonic()
        windows = args.max_lanes * (args.drafts + 1)  # every lane's verify window: the most rows a round draws at
        round_rows = args.prompt_budget + windows  # prompt chunks beside every window
        rows = {"trunk": round_rows, "verify": min(windows, VERIFY_ROWS), "prompt": round_rows, "mtp": round_rows}
        try:
            graphs = kernel_path.enable_graphs(model, rows, windows)
        except torch.OutOfMemoryError as exc:
            raise SystemExit(
                f"--cuda-graphs: capturing rounds of up to {round_rows} rows ran out of GPU memory beside the lane "
                f"pool's {pool.nbytes() / 2**30:.2f} GiB; lower --max-lanes, --prompt-budget or --context, or pass "
                "--cuda-graphs off"
            ) from exc
        took, shared = time.monotonic() - started, graphs.shared.nbytes() / 2**30
        log.info("CUDA graphs: buckets %s captured in %.1f s; outputs %.2f GiB", graphs.buckets, took, shared)
    return context


def canonical_settings(args: argparse.Namespace, world: int, env: EnvSettings) -> dict[str, object]:
    """What both ranks must agree on; the handshake compares these. Of the FLASHNEXT_* settings only
    FLASHNEXT_PEER_SUMS, which decides the collectives a rank enters: PDL, Gluon and the side stream's overlap change
    kernels or streams with the same bits and put no collective on the side stream, so the ranks may differ there."""
    config = (args.model / "config.json").read_bytes()
    return {
        "model": args.model.name,
        "config_sha256": hashlib.sha256(config).hexdigest(),
        "tp": world,
        "device": args.device,
        "dtype": args.dtype,
        "kernels": "on" if resolve_kernels(args.kernels, args.device) else "off",
        "cuda_graphs": args.cuda_graphs,
        "context": args.context or "auto",
        "gpu_memory_utilization": args.gpu_memory_utilization or "all free",
        "max_lanes": args.max_lanes,
        "prompt_budget": args.prompt_budget,
        "drafts": args.drafts,
        "load_format": args.load_format,
        "ngram_table": args.ngram_table,
        "prompt_cache_gib": args.prompt_cache_gib if args.prompt_cache_gib is not None else "auto",
        "prompt_cache_grid": args.prompt_cache_grid,
        "header_codec": HEADER_VERSION,
        "environment": {"FLASHNEXT_PEER_SUMS": env.peer_sums},
    }


@dataclass(slots=True)
class Serving:
    """Rank 0's side of serving: the engine and its metrics, the tokenizer, and what the HTTP side is told."""

    engine: Engine
    metrics: EngineMetrics
    tokenizer: Any | None
    front: FrontSettings

    def local_state(self) -> ServerState:
        """The app's state with the engine on a thread of this process (`--frontend thread`)."""
        front = self.front
        engine = LocalEngine(self.engine, self.metrics)
        return ServerState(
            engine,
            self.tokenizer,
            front.model_name,
            front.context,
            front.vocab_size,
            front.eos_ids,
            front.api_key,
            front.sampling_defaults,
            front.http,
            front.model_aliases,
        )


def serving_defaults(args: argparse.Namespace) -> SamplingDefaults:
    """The sampling defaults of --generation-config and --override-generation-config, logged where there are any."""
    defaults = defaults_from_flags(args.model, args.generation_config, args.override_generation_config)
    if defaults.given():
        log.info(
            "sampling defaults for fields a request leaves out (--generation-config %s; vllm: none): %s",
            args.generation_config,
            ", ".join(f"{name} {value}" for name, value in defaults.given().items()),
        )
    return defaults


def create_serving(args: argparse.Namespace, model=None, runner=None, on_fatal=None) -> Serving:
    """Rank 0's engine and what its front end needs, from the serve flags (a model and runner may be given)."""
    defaults = serving_defaults(args)
    model = model or load_model(
        args.model,
        device=args.device,
        dtype=args.dtype,
        load_format=args.load_format,
        ngram_table=args.ngram_table,
        kernels=args.kernels,
    )
    cfg = model.cfg
    context = plan_lanes(args, model)
    free = free_memory(model.device, args.gpu_memory_utilization)
    tokenizer = load_tokenizer(args.model, args.chat_template, args.tokenizer)
    name, *aliases = args.served_model_name or [args.model.name]
    if tokenizer is not None:
        parser = tool_call_parser(args.tool_call_parser, tokenizer)
        log.info("tool calls: <tool_call> blocks read as %s (--tool-call-parser %s)", parser, args.tool_call_parser)
    metrics = EngineMetrics(name, context)
    runner = runner or ModelRunner(model, args.max_lanes)
    drafter = DRAFTERS[args.drafter]()
    if args.drafts and not runner.can_draft:
        proposed = "only copy drafts are" if drafter.reads_history else "no drafts are"
        log.warning("%s has no MTP layer: %s proposed", args.model, proposed)
    cache_bytes = (
        int(args.prompt_cache_gib * 2**30)
        if args.prompt_cache_gib is not None
        else (free // 4 if model.device.type == "cuda" else 2**30)
    )
    cache = PromptCache(cache_bytes)
    engine = Engine(
        runner,
        context,
        args.prompt_budget,
        metrics,
        on_fatal,
        args.drafts,
        drafter,
        cache,
        args.prompt_cache_grid,
        args.plan_ahead == "on",
        Guides(tokenizer, cfg.vocab_size) if tokenizer is not None else None,
        args.scheduling_policy == "priority",
    )
    metrics.track_cache(cache)
    metrics.track_collectives(model.tp.counts)
    metrics.track_counts(engine.counts)
    log.info(
        "serving %s as %r: context %d, %d lanes, prompt budget %d tokens a round, prompt cache %.2f GiB, tp %d",
        args.model,
        name,
        context,
        args.max_lanes,
        args.prompt_budget,
        cache_bytes / 2**30,
        model.tp.world,
    )
    front = FrontSettings(
        model_path=args.model,
        model_name=name,
        model_aliases=tuple(aliases),
        context=context,
        vocab_size=cfg.vocab_size,
        eos_ids=eos_token_ids(args.model, tokenizer, cfg.eos_token_id, cfg.vocab_size),
        api_key=args.api_key,
        chat_template=args.chat_template,
        tokenizer_path=args.tokenizer,
        cache_enabled=cache.enabled,
        priority_scheduling=engine.priority_scheduling,
        host=args.host,
        port=args.port,
        sampling_defaults=defaults,
        http=http_options(args),
    )
    return Serving(engine, metrics, tokenizer, front)


def connect_ranks(args: argparse.Namespace, ranks: RankEnv, env: EnvSettings) -> ControlLink:
    """Open the control link (rank 0 listens, rank 1 connects) and compare settings."""
    port = control_link_port(ranks, env.link_port)
    if ranks.rank == 0:
        try:
            listener = ControlLink.listen(control_link_host(ranks.master_addr), port)
        except OSError as exc:
            where = "as set" if env.link_port else "unset, it is MASTER_PORT + 1"
            raise SystemExit(
                f"FLASHNEXT_LINK_PORT: rank 0 cannot listen for the control link on port {port} ({where}): "
                f"{exc.strerror or exc}; set it to a free port"
            ) from exc
    try:
        if ranks.rank == 0:
            try:
                link = listener.accept(timeout=env.tp_timeout_s * 10)
            finally:
                listener.close()
        else:
            link = ControlLink.connect(ranks.master_addr, port, timeout=env.tp_timeout_s * 10)
    except TimeoutError as exc:
        raise SystemExit(
            f"FLASHNEXT_TP_TIMEOUT_S={env.tp_timeout_s:g}: {exc} (the ranks wait ten times it for each other at "
            "start); raise it if a rank is slow to start"
        ) from exc
    link.handshake(canonical_settings(args, ranks.world, env))
    return link


def load_rank(args: argparse.Namespace, ranks: RankEnv, env: EnvSettings) -> ModelRunner:
    """Join the process group and build this rank's model (its shard of the weights) and runner from the flags."""
    device = init_group(ranks, args.device, env.tp_timeout_s)
    peer = None
    if env.peer_sums:
        from model.peer_sums import PeerSums  # loads Triton

        peer = PeerSums.open(device, load_config(args.model).hidden_size)
    model = load_model(
        args.model,
        device=device,
        dtype=args.dtype,
        tp=TensorParallel(ranks.rank, ranks.world, peer=peer),
        load_format=args.load_format,
        ngram_table=args.ngram_table,
        kernels=args.kernels,
    )
    return rank_runner(model, args.max_lanes, ranks.rank, env)


def rank_runner(model, max_lanes: int, rank: int, env: EnvSettings) -> ModelRunner:
    """This rank's runner, writing the round digests and trace the environment asks for into rank{r}.* files."""
    digests = None if env.round_digests is None else Path(env.round_digests) / f"rank{rank}.digests"
    trace_path = None if env.round_trace is None else Path(env.round_trace) / f"rank{rank}.trace"
    if trace_path is None and (env.round_profile is not None or env.round_pyprofile is not None):
        log.warning("FLASHNEXT_ROUND_PROFILE and _PYPROFILE write beside the round trace: without one, nothing")
    trace = RoundTrace(trace_path, env.round_profile, env.round_pyprofile)
    return ModelRunner(model, max_lanes, digests, trace)


def run_serve(args: argparse.Namespace, argv: list[str]) -> int:
    """Serve at tp 1, start both ranks for `--tp 2`, or be one rank under torchrun."""
    env = read_environment(os.environ)  # main's start_refusal has refused a malformed one
    args.api_key = tuple(args.api_key or ()) or ((env.api_key,) if env.api_key else None)  # --api-key's, else the env's
    ranks = rank_env(args.tp)
    if launches_ranks(ranks):
        return launch(argv, ranks.world, cpu=args.device == "cpu")
    listener = listen_socket(args.host, args.port) if ranks.rank == 0 else None  # before minutes of loading
    try:
        return serve_rank(args, ranks, env, listener)
    finally:
        if listener is not None:
            listener.close()
        leave_group()


def serve_rank(args: argparse.Namespace, ranks: RankEnv, env: EnvSettings, listener: socket.socket | None) -> int:
    """Connect the ranks, load this one's half, then serve HTTP on `listener` (rank 0) or run rank 0's plans."""
    if listener is not None:
        host, port = listener.getsockname()[:2]
        log.info("listening on %s://%s:%d%s", "https" if args.ssl_certfile else "http",
                 f"[{host}]" if ":" in host else host, port,
                 " (API key required)" if args.api_key else "")  # fmt: skip
    link = None
    if ranks.world > 1:
        try:
            link = connect_ranks(args, ranks, env)
        except SettingsMismatch as exc:
            log.error("the ranks disagree: %s", exc)
            return 1
        if ranks.rank > 0:  # not before: until the link is up no rank 0 can stop this rank
            hold_signals_for_rank0()
    runner = load_rank(args, ranks, env)
    model = runner.model
    if listener is None:
        plan_lanes(args, model)  # rank 0 plans in create_serving: the same pool, graphs captured in the same order
        return follow(link, runner, env.tp_timeout_s)
    return serve_http(args, model, LinkedRunner(runner, link, env.tp_timeout_s) if link else runner, link, listener)


def serve_http(args: argparse.Namespace, model, runner, link: ControlLink | None, listener: socket.socket) -> int:
    """Rank 0: the engine, and the HTTP front end in its own process or on this one's main thread; SIGTERM/SIGINT
    shut down cleanly (exit 0), a fatal failure ends every request with an error and exits 1."""
    exit_code = 0
    stop_serving = None

    def fatal(message: str) -> None:
        nonlocal exit_code
        exit_code = 1
        if stop_serving is not None:
            stop_serving()
        threading.Timer(15, os._exit, (1,)).start()  # a shutdown that hangs still ends the process

    serving = create_serving(args, model, runner, fatal)
    stop_watch = threading.Event()
    if link is not None:
        threading.Thread(target=watch_peer, args=(link, serving.engine.fail, stop_watch), daemon=True).start()
    if args.frontend == "process":
        frontend = FrontendProcess(serving.front, listener, serving.engine, serving.metrics)
        stop_serving = frontend.request_stop
        code = frontend.run()
    else:
        server = http_server(serving.local_state(), serving.front)
        stop_serving = lambda: setattr(server, "should_exit", True)  # noqa: E731
        server.run(sockets=[listener])
        code = 0
    stop_watch.set()
    return max(code, exit_code)
