"""`flashnext serve`: load the model, size the context, start the engine and the HTTP server."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import torch

from model.state import lane_state_bytes
from model.weights import load_model
from server.app import ServerState, build_app
from server.engine import Engine
from server.metrics import EngineMetrics
from server.runner import ModelRunner
from server.tokenizer import eos_token_ids, load_tokenizer

log = logging.getLogger(__name__)


def free_memory(device: torch.device) -> int:
    """Bytes free for lane state on `device`."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
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


def create_state(args: argparse.Namespace) -> ServerState:
    """Everything the app needs, from the serve flags."""
    model = load_model(args.model, device=args.device, dtype=args.dtype)
    cfg = model.cfg
    if args.context is not None and args.context > cfg.max_position_embeddings:
        raise SystemExit(f"--context: {args.context} exceeds the model's {cfg.max_position_embeddings} positions")
    dtype_bytes = torch.finfo(model.dtype).bits // 8
    context = choose_context(
        args.context,
        cfg.max_position_embeddings,
        lambda n: lane_state_bytes(cfg, n, dtype_bytes),
        free_memory(model.device),
    )
    tokenizer = load_tokenizer(args.model)
    name = args.served_model_name or args.model.name
    metrics = EngineMetrics(name)
    engine = Engine(ModelRunner(model, args.max_lanes), context, args.prompt_budget, metrics)
    log.info(
        "serving %s as %r: context %d, %d lanes, prompt budget %d tokens a round",
        args.model,
        name,
        context,
        args.max_lanes,
        args.prompt_budget,
    )
    return ServerState(
        engine=engine,
        tokenizer=tokenizer,
        model_name=name,
        context=context,
        vocab_size=cfg.vocab_size,
        eos_ids=eos_token_ids(args.model, tokenizer, cfg.eos_token_id),
        metrics=metrics,
        api_key=args.api_key,
    )


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    app = build_app(create_state(args))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
