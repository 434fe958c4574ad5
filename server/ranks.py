"""The ranks: torchrun's environment, the process group, and `--tp 2` starting both ranks itself."""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# Its functions take `group.WORLD` as a default argument when the module is first imported (torch._dynamo imports it,
# lazily): imported after the group exists, they would hold the group alive past `leave_group`.
import torch.distributed.nn.functional

from server.threads import give_thread_pools_a_share

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RankEnv:
    """Where this process sits among the ranks, as torchrun describes it."""

    rank: int = 0
    local_rank: int = 0
    world: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500


def rank_env(tp: int | None, environ: dict[str, str] | None = None) -> RankEnv:
    """Read RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; `--tp` must agree with WORLD_SIZE, and a
    world of several ranks needs RANK (each refused by name)."""
    env = os.environ if environ is None else environ
    if "WORLD_SIZE" not in env:
        return RankEnv(world=1) if tp in (None, 1) else RankEnv(world=tp)
    world = _int_var(env, "WORLD_SIZE")
    if world > 1 and "RANK" not in env:
        raise SystemExit(
            f"RANK: unset while WORLD_SIZE is {world}; start the ranks with torchrun, or unset WORLD_SIZE and pass "
            "--tp to start them"
        )
    rank = _int_var(env, "RANK", "0")
    local = _int_var(env, "LOCAL_RANK", str(rank))
    port = _int_var(env, "MASTER_PORT", "29500")
    if not 0 < port < 65536:
        raise SystemExit(f"MASTER_PORT: {port} is not a TCP port")
    if tp is not None and tp != world:
        raise SystemExit(f"--tp: {tp} differs from WORLD_SIZE {world}")
    if world not in (1, 2) or not 0 <= rank < world:
        raise SystemExit(f"WORLD_SIZE/RANK: tensor parallel 1 or 2 is supported, got world {world}, rank {rank}")
    return RankEnv(rank, local, world, env.get("MASTER_ADDR", "127.0.0.1"), port)


def _int_var(env: Mapping[str, str], name: str, default: str | None = None) -> int:
    """One of torchrun's integer variables (`default` where it is unset), refused by name if it is not an integer."""
    text = env.get(name, default)
    try:
        return int(text)
    except (TypeError, ValueError):
        raise SystemExit(f"{name}: {text!r} is not an integer") from None


def launches_ranks(env: RankEnv, environ: dict[str, str] | None = None) -> bool:
    """Whether this process starts the ranks itself (`--tp 2` outside torchrun) rather than being one of them."""
    return env.world > 1 and "WORLD_SIZE" not in (os.environ if environ is None else environ)


def init_group(env: RankEnv, device: str, timeout_s: float) -> torch.device:
    """Join the process group (NCCL on CUDA, gloo on CPU); returns this rank's device."""
    if device == "cuda":
        torch.cuda.set_device(env.local_rank)
        where = torch.device("cuda", env.local_rank)
    else:
        where = torch.device("cpu")
    if env.world > 1:
        dist.init_process_group(
            "nccl" if device == "cuda" else "gloo",
            init_method=f"tcp://{env.master_addr}:{env.master_port}",
            rank=env.rank,
            world_size=env.world,
            timeout=timedelta(seconds=timeout_s),
        )
    return where


def leave_group() -> None:
    """Destroy a gloo process group while the interpreter is whole (NCCL's teardown is not yet checked on two GPUs)."""
    # gloo's worker threads may still hold a finished collective's tensors; releasing them once the interpreter is
    # finalizing aborts the process (SIGABRT, "terminate called without an active exception")
    if dist.is_initialized() and dist.get_backend() == "gloo":
        dist.destroy_process_group()


FOLLOWER_GRACE_S = 60  # how long a signalled rank 1 waits for rank 0 to stop it (rank 0 gives responses 30 s)


def hold_signals_for_rank0(grace_s: float = FOLLOWER_GRACE_S) -> None:
    """On rank 1, once the control link is up: SIGTERM and SIGINT (torchrun sends every rank one; a terminal's Ctrl-C
    reaches its whole process group) leave the stop to rank 0, which ends rank 1 over the control link once its open
    responses are done; only if that has not happened `grace_s` after the first signal does rank 1 exit (1) by
    itself."""
    deadline: list[threading.Timer] = []

    def later(signum: int, _frame) -> None:
        if not deadline:
            log.info("%s: rank 1 stops when rank 0 tells it (at the latest in %.0f s)", signal.Signals(signum).name,
                     grace_s)  # fmt: skip
            timer = threading.Timer(grace_s, os._exit, (1,))
            timer.daemon = True
            deadline.append(timer)
            timer.start()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, later)


def free_ports(count: int) -> list[int]:
    """`count` distinct free TCP ports on the loopback (held together while they are picked)."""
    with ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]


def free_port() -> int:
    """A free TCP port on the loopback."""
    return free_ports(1)[0]


def control_link_port(ranks: RankEnv, link_port: int | None) -> int:
    """The control link's port: FLASHNEXT_LINK_PORT's when set, else the one after the master's."""
    if link_port:
        return link_port
    if ranks.master_port >= 65535:
        raise SystemExit(f"FLASHNEXT_LINK_PORT: unset, and MASTER_PORT {ranks.master_port} has no port after it")
    return ranks.master_port + 1


def control_link_host(master_addr: str) -> str:
    """Where rank 0 listens for the control link: the loopback interface when MASTER_ADDR is an IPv4 loopback address
    or localhost (the ranks share a host; no other host can then reach a link that takes the first peer to connect),
    else every interface."""
    if master_addr == "localhost":
        return "127.0.0.1"
    with contextlib.suppress(ValueError):
        address = ipaddress.ip_address(master_addr)
        if address.version == 4 and address.is_loopback:
            return master_addr
    return "0.0.0.0"


def rank_environments(world: int, environ: dict[str, str], cpu: bool = False) -> list[dict[str, str]]:
    """Each rank's environment for `--tp`: torchrun's variables on a free master port, and a control link port
    checked free as well unless FLASHNEXT_LINK_PORT names one (the port after the master's may be taken). On the CPU
    (`cpu`) each rank's thread pools take its share of the cores, unless set: pools sized for the whole machine in
    every rank spin waiting on each other's threads."""
    master, link = free_ports(2)
    shared = {**environ, "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master)}
    shared.setdefault("FLASHNEXT_LINK_PORT", str(link))
    if cpu:
        give_thread_pools_a_share(shared, world)
    return [{**shared, "RANK": str(rank), "LOCAL_RANK": str(rank)} for rank in range(world)]


PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when its parent dies


def _end_with_launcher() -> None:
    """In a rank, before it runs (Linux): a SIGTERM when the launcher dies, which its own session would hide."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def launch(argv: list[str], world: int, cpu: bool = False) -> int:
    """Start `world` rank processes of `python -m server ARGV` with torchrun's variables (`cpu`: ranks on the CPU, each
    with its share of the cores); stop all when one fails.
    Each rank leads a session of its own, so a terminal's Ctrl-C reaches only this process, which passes each signal
    to rank 0's process group (rank 0 and its front end, as a terminal would at tp 1; a hangup as SIGTERM); rank 0
    stops rank 1 over the control link, and a rank whose launcher dies gets a SIGTERM."""
    procs: list[subprocess.Popen] = []
    pending: list[int] = []  # a signal that came before rank 0 started

    def forward(signum: int, _frame) -> None:
        signum = signal.SIGTERM if signum == signal.SIGHUP else signum
        if not procs:
            pending.append(signum)
        elif procs[0].poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(procs[0].pid, signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    for env in rank_environments(world, dict(os.environ), cpu):
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "server", *argv], env=env, start_new_session=True, preexec_fn=_end_with_launcher
            )
        )
    for signum in pending:
        forward(signum, None)
    code = 0
    while any(p.poll() is None for p in procs):
        failed = [p for p in procs if p.poll() not in (None, 0)]
        if failed and code == 0:
            code = failed[0].returncode
            log.error("rank %d exited with %d: stopping the others", procs.index(failed[0]), code)
            deadline = time.monotonic() + 10
            for proc in procs:
                if proc.poll() is None:
                    proc.terminate()
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                time.sleep(0.05)
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
        time.sleep(0.05)
    # every rank is gone: a late signal has nowhere to go, and must not kill this process as Python finalizes
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    code = code or next((p.returncode for p in procs if p.returncode), 0)
    return 128 - code if code < 0 else code  # a rank a signal ended: the shell's 128 + signal, not sys.exit's 256 - it
