"""Serve rank 0's half of a tensor-parallel model alone on one device, collectives skipped (timing only).

The served rounds' host side (engine, draws, HTTP front end) with one rank's kernels, where no second GPU is lent:
all-reduces leave their input as it is and all-gathers copy the local part into every slot
(`gpu_step_profile.collectives_skipped`), so the outputs are not the model's, only the time is. There is no control
link and no rank 1: the served step is rank 0's, without the collectives' and the link's cost.

python3 scripts/serve_alone.py --alone-as 2 MODEL [serve flags]   # as `python -m server MODEL ...` at --tp 1
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]

from gpu_step_profile import collectives_skipped  # noqa: E402

from model.parallel import TensorParallel  # noqa: E402
from model.weights import load_model  # noqa: E402
from server.cli import build_parser, start_refusal  # noqa: E402
from server.frontend import listen_socket  # noqa: E402
from server.serve import rank_runner, serve_http  # noqa: E402
from server.settings import read_environment  # noqa: E402

USAGE = "usage: serve_alone.py --alone-as WORLD MODEL [serve flags]"


def split_world(argv: list[str]) -> tuple[int, list[str]]:
    """(WORLD, the serve flags) from `--alone-as WORLD ...`; SystemExit naming the flag when it is missing or bad."""
    if len(argv) < 2 or argv[0] != "--alone-as":
        raise SystemExit(f"{USAGE}\n--alone-as: required first, with the world size whose rank 0 is served")
    try:
        world = int(argv[1])
    except ValueError:
        world = 0
    if world < 2:
        raise SystemExit(f"--alone-as: {argv[1]!r} is not a world of two or more ranks")
    return world, argv[2:]


def main(argv: list[str] | None = None) -> int:
    """Parse, refuse bad flags by name, load rank 0's half and serve it until SIGTERM/SIGINT."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    world, rest = split_world(list(sys.argv[1:] if argv is None else argv))
    args = build_parser().parse_args(["serve", *rest])
    if args.tp not in (None, 1):
        raise SystemExit("--tp: serve_alone runs one rank; give the world to --alone-as instead")
    if not (args.model / "config.json").is_file():
        raise SystemExit(f"model: no config.json in {args.model}")
    try:  # a ValueError names the setting or file at fault, as the serve command prints it
        refusal = start_refusal(args)
        env = read_environment(os.environ)
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc
    if refusal is not None:
        raise SystemExit(refusal)
    args.api_key = tuple(args.api_key or ()) or ((env.api_key,) if env.api_key else None)  # --api-key's, else the env's
    listener = listen_socket(args.host, args.port)
    try:
        with collectives_skipped():
            model = load_model(
                args.model,
                device=args.device,
                dtype=args.dtype,
                tp=TensorParallel(0, world),
                load_format=args.load_format,
                ngram_table=args.ngram_table,
                kernels=args.kernels,
            )
            runner = rank_runner(model, args.max_lanes, 0, env)
            runner.agreement = lambda _problem: None  # no rank 1 to refuse a round
            return serve_http(args, model, runner, None, listener)
    finally:
        listener.close()


if __name__ == "__main__":
    sys.exit(main())
