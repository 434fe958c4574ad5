"""`--tp` starting its own ranks: the ports it hands them, and a rank leaving its process group before it exits."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from server import ranks, threads
from server.settings import read_environment


def effective_link_port(env: dict[str, str]) -> int:
    """The control link port a rank with this environment listens on or connects to."""
    return ranks.control_link_port(ranks.rank_env(None, env), read_environment(env).link_port)


def test_the_link_port_is_free_even_when_the_port_after_the_masters_is_taken(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        picks = iter([[taken - 1, ranks.free_port()]])
        monkeypatch.setattr(ranks, "free_ports", lambda count: next(picks)[:count])
        envs = ranks.rank_environments(2, {})
        links = {effective_link_port(env) for env in envs}
        assert len(links) == 1 and taken not in links
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", links.pop()))  # free: rank 0 can listen on it
    assert [(env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) for env in envs] == [("0", "0", "2"), ("1", "1", "2")]
    assert {env["MASTER_PORT"] for env in envs} == {str(taken - 1)}


def test_ranks_on_the_cpu_split_its_cores_unless_their_pools_are_set(monkeypatch):
    monkeypatch.setattr(threads, "usable_cores", lambda: 16)
    on_cpu = ranks.rank_environments(2, {}, cpu=True)
    assert [(env["OMP_NUM_THREADS"], env["MKL_NUM_THREADS"]) for env in on_cpu] == [("8", "8"), ("8", "8")]
    assert all("OMP_NUM_THREADS" not in env for env in ranks.rank_environments(2, {}))  # on a GPU: as torch sizes it
    assert {env["OMP_NUM_THREADS"] for env in ranks.rank_environments(2, {"OMP_NUM_THREADS": "3"}, cpu=True)} == {"3"}
    monkeypatch.setattr(threads, "usable_cores", lambda: 1)
    assert {env["OMP_NUM_THREADS"] for env in ranks.rank_environments(2, {}, cpu=True)} == {"1"}


def test_a_link_port_the_user_set_is_kept():
    envs = ranks.rank_environments(2, {"FLASHNEXT_LINK_PORT": "40123"})
    assert [effective_link_port(env) for env in envs] == [40123, 40123]


@pytest.mark.parametrize("port", ["-5", "0", "70000"])
def test_a_master_port_that_is_no_tcp_port_is_refused_by_name(port):
    """-5 passed, and rank 0 ended in an OverflowError traceback binding the control link on MASTER_PORT + 1; 70000
    was blamed on FLASHNEXT_LINK_PORT, or with that set reached the process group's rendezvous."""
    with pytest.raises(SystemExit, match=f"MASTER_PORT: {port} is not a TCP port"):
        ranks.rank_env(None, {"WORLD_SIZE": "2", "RANK": "0", "MASTER_PORT": port})
    assert ranks.rank_env(None, {"WORLD_SIZE": "2", "RANK": "0", "MASTER_PORT": "65535"}).master_port == 65535


@pytest.mark.parametrize("count", [1, 2, 5])
def test_free_ports_are_distinct_and_bindable(count):
    ports = ranks.free_ports(count)
    assert len(set(ports)) == count
    for port in ports:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", port))


ROOT = Path(__file__).resolve().parents[2]

# A rank whose serving joined a gloo group and ran a collective: the native threads left once `run_serve` returns.
SERVED_RANK = """
import argparse, importlib, os, sys
from datetime import timedelta
import torch
import torch.distributed as dist
from server import serve

def threads():
    return len(os.listdir("/proc/self/task"))

def serve_rank(args, ranks, env, listener):
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    dist.all_reduce(torch.ones(8))
    importlib.import_module("torch._dynamo")  # as the model load does (torch.nn.init): it imports torch.distributed.nn
    return 0

torch.set_num_threads(1)
before = threads()
serve.serve_rank = serve_rank
args = argparse.Namespace(api_key=None, tp=None, host="127.0.0.1", port=0, device="cpu", kernels="off")
code = serve.run_serve(args, [])
print(code, before, threads(), dist.is_initialized())
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts native threads through /proc")
def test_a_rank_leaves_its_gloo_group_before_the_interpreter_exits():
    """gloo's worker threads, still alive at interpreter exit, can abort a rank that served cleanly (SIGABRT: they
    release a finished collective's tensors once the interpreter is finalizing); run_serve destroys the group, and
    nothing imported after the group was made (torch._dynamo, when the model loads) keeps it alive."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    done = subprocess.run(
        [sys.executable, "-c", SERVED_RANK, str(ranks.free_port())], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    code, before, after, still_in_group = done.stdout.split()
    assert (code, still_in_group) == ("0", "False")
    assert after == before  # no gloo worker or store thread left behind


def test_a_link_port_in_use_on_rank_0_is_refused_naming_the_setting():
    """Under torchrun the link port (MASTER_PORT + 1 unless set) is not checked free; rank 0 then died with a bare
    OSError that named neither the port's setting nor how to pick another."""
    from server.serve import connect_ranks
    from server.settings import EnvSettings

    with socket.create_server(("0.0.0.0", 0)) as held:
        taken = held.getsockname()[1]
        for env, where in ((EnvSettings(link_port=taken), "as set"), (EnvSettings(), "unset, it is MASTER_PORT + 1")):
            with pytest.raises(SystemExit, match=rf"FLASHNEXT_LINK_PORT.*{taken} \({re.escape(where)}\)"):
                connect_ranks(None, ranks.RankEnv(rank=0, world=2, master_port=taken - 1), env)


def test_a_master_port_with_no_port_after_it_is_refused_naming_the_link_port():
    """MASTER_PORT 65535 left the link on port 65536: each rank crashed with a bare OverflowError from the socket."""
    env = {"WORLD_SIZE": "2", "RANK": "1", "MASTER_PORT": "65535"}
    with pytest.raises(SystemExit, match="FLASHNEXT_LINK_PORT"):
        effective_link_port(env)
    assert effective_link_port({**env, "FLASHNEXT_LINK_PORT": "40123"}) == 40123


@pytest.mark.parametrize(
    ("rank1_environ", "differs"),
    [
        ({"FLASHNEXT_PEER_SUMS": "1"}, "environment.FLASHNEXT_PEER_SUMS"),  # other collectives: the ranks would hang
        ({"FLASHNEXT_PEER_SUMS": "0"}, None),  # the default, written out
        ({"FLASHNEXT_OVERLAP": "moe", "FLASHNEXT_GLUON": "0"}, None),  # streams and kernels of the same bits
    ],
)
def test_the_handshake_compares_the_settings_that_shape_a_ranks_work(monkeypatch, rank1_environ, differs):
    """Two ranks started with different collective settings would wait forever on each other; the handshake refuses
    them naming the setting, and the same meaning written two ways passes, as do kernels that give the same bits."""
    import threading

    from model.shipped import SHIPPED_MODEL
    from rankwire.errors import SettingsMismatch
    from rankwire.link import ControlLink
    from server.cli import build_parser
    from server.serve import canonical_settings

    args = build_parser().parse_args(["serve", str(SHIPPED_MODEL), "--tp", "2"])
    for name in [*rank1_environ, "FLASHNEXT_PEER_SUMS"]:
        monkeypatch.delenv(name, raising=False)
    rank0_settings = canonical_settings(args, 2, read_environment(os.environ))
    for name, value in rank1_environ.items():
        monkeypatch.setenv(name, value)
    rank1_settings = canonical_settings(args, 2, read_environment(os.environ))
    a, b = socket.socketpair()
    links, errors = (ControlLink(a, rank=0), ControlLink(b, rank=1)), [None, None]

    def shake(rank: int, settings: dict) -> None:
        try:
            links[rank].handshake(settings, timeout=5)
        except SettingsMismatch as exc:
            errors[rank] = str(exc)

    threads = [threading.Thread(target=shake, args=(r, s)) for r, s in enumerate((rank0_settings, rank1_settings))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    for link in links:
        link.close()
    if differs is None:
        assert errors == [None, None]
    else:
        assert all(error is not None and differs in error for error in errors), errors


def test_a_world_of_two_without_rank_is_refused_naming_rank():
    """WORLD_SIZE=2 left in the environment without RANK made `flashnext serve --tp 2` a lone rank 0 (it starts no
    ranks under WORLD_SIZE) that waited ten times FLASHNEXT_TP_TIMEOUT_S for a rank 1 nobody started, then blamed
    that timeout; two processes missing RANK were both rank 0."""
    for tp in (None, 2):
        with pytest.raises(SystemExit, match=r"^RANK: unset while WORLD_SIZE is 2"):
            ranks.rank_env(tp, {"WORLD_SIZE": "2", "MASTER_PORT": "29500"})
    assert ranks.rank_env(None, {"WORLD_SIZE": "1"}).rank == 0  # one rank needs no RANK


@pytest.mark.parametrize("name", ["WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT"])
def test_a_torchrun_variable_that_is_no_integer_is_refused_by_its_own_name(name):
    """The refusal named all four variables at once, leaving the user to find the one at fault."""
    env = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_PORT": "29500", name: "one"}
    with pytest.raises(SystemExit, match=rf"^{name}: 'one' is not an integer$"):
        ranks.rank_env(None, env)


def test_rank_1_stops_on_sigterm_before_the_control_link_is_up():
    """Rank 1 held SIGTERM for rank 0 from its first moment, when no rank 0 could stop it yet: a rank 0 that failed
    at start (its HTTP port in use) left the launcher's SIGTERM to rank 1 ignored until SIGKILL, and a rank 1 waiting
    on the link ran on to its own timeout. Here rank 0's listener takes the connection and says nothing."""
    with socket.create_server(("127.0.0.1", 0)) as rank0:
        env = {
            **os.environ,
            "WORLD_SIZE": "2",
            "RANK": "1",
            "LOCAL_RANK": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(ranks.free_port()),
            "FLASHNEXT_LINK_PORT": str(rank0.getsockname()[1]),
        }
        rank1 = subprocess.Popen(
            [sys.executable, "-m", "server", "--device", "cpu"], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True
        )
        try:
            rank0.settimeout(120)
            peer, _ = rank0.accept()  # rank 1 is in the handshake, waiting for rank 0's settings
            with peer:
                rank1.send_signal(signal.SIGTERM)
                code = rank1.wait(timeout=120)
        finally:
            if rank1.poll() is None:
                rank1.kill()
            rank1.wait()
    assert code == -signal.SIGTERM, rank1.stderr.read()[-3000:]


def test_a_rank_killed_by_a_signal_ends_the_launcher_with_the_shells_code(monkeypatch):
    """A rank that dies of SIGTERM makes the launcher exit 143 (128 + 15), as a shell reports it, not -15 (which
    sys.exit turns into 241)."""
    real_popen = subprocess.Popen
    dies = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"]
    monkeypatch.setattr(ranks.subprocess, "Popen", lambda _args, **kwargs: real_popen(dies, **kwargs))
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        code = ranks.launch(["--tp", "2"], 2)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert code == 128 + signal.SIGTERM


@pytest.mark.parametrize(
    ("master_addr", "host"),
    [("127.0.0.1", "127.0.0.1"), ("127.0.0.2", "127.0.0.2"), ("localhost", "127.0.0.1"), ("10.1.2.3", "0.0.0.0"),
     ("node-7", "0.0.0.0"), ("::1", "0.0.0.0")],
)  # fmt: skip
def test_the_control_link_listens_on_loopback_when_the_master_is_this_host(master_addr, host):
    """Rank 0 takes the first peer that connects to the control link: with the ranks on one host (the `--tp`
    launcher's MASTER_ADDR, 127.0.0.1) no other host may reach it; a master named otherwise keeps every interface."""
    assert ranks.control_link_host(master_addr) == host


def test_rank_0_listens_for_the_link_where_control_link_host_says(monkeypatch):
    """`connect_ranks` asks `control_link_host` for rank 0's interface (it listened on every one, whatever the
    master)."""
    from server import serve
    from server.settings import read_environment

    listened: list[tuple[str, int]] = []

    def listen(host: str, port: int):
        listened.append((host, port))
        raise OSError(98, "stop here")

    monkeypatch.setattr(serve.ControlLink, "listen", staticmethod(listen))
    env = ranks.rank_env(None, {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    with pytest.raises(SystemExit, match="FLASHNEXT_LINK_PORT"):
        serve.connect_ranks(None, env, read_environment({}))
    assert listened == [("127.0.0.1", 29501)]


LATE_SIGNAL_LAUNCHER = """
import signal, subprocess, sys
from server import ranks

rank = "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); print('ready', flush=True); time.sleep(0.3)"
real_popen = subprocess.Popen
ranks.subprocess.Popen = lambda _args, **kwargs: real_popen([sys.executable, "-c", rank], **kwargs)
sys.exit(ranks.launch(["--tp", "2"], 2))
"""


def test_ctrl_c_pressed_on_and_on_while_the_ranks_exit_lets_the_launcher_exit_0():
    """Ctrl-C held down as the ranks end: the launcher has nothing left to pass it to and exits 0, never killed by a
    SIGINT that comes once Python has put the default handlers back on its way out."""
    launcher = subprocess.Popen(
        [sys.executable, "-c", LATE_SIGNAL_LAUNCHER], cwd=Path(__file__).resolve().parents[2], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert [launcher.stdout.readline() for _ in range(2)] == ["ready\n"] * 2  # both ranks ignore SIGINT by now
    while launcher.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            launcher.send_signal(signal.SIGINT)
        time.sleep(0.0005)
    assert launcher.returncode == 0, launcher.stderr.read()[-3000:]
