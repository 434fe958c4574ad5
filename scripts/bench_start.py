"""Start-up: seconds from `python -m server ARGS` to the first 200 from /health, and, after one chat request, the
front-end process's resident memory and whether it loaded torch (Linux: /proc). Each rep starts a fresh server.

    python scripts/bench_start.py --reps 3                        # the shipped model, on CPU
    python scripts/bench_start.py --reps 3 -- --tp 2              # flags after -- are the server's
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from server.ranks import free_port  # noqa: E402


def spawned_children(pid: int) -> list[int]:
    """The multiprocessing-spawned descendants of `pid` (the front-end process), searched through every level."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for child in map(int, Path(f"/proc/{parent}/task/{parent}/children").read_text().split()):
            todo.append(child)
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(child)
    return found


def one_start(flags: list[str], limit_s: float) -> dict[str, object]:
    """One server: seconds to healthy, then the front end's resident kB and torch after a chat request."""
    port = free_port()
    argv = [sys.executable, "-m", "server", *flags, "--host", "127.0.0.1", "--port", str(port)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    start = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None or time.perf_counter() - start > limit_s:
                raise SystemExit(f"the server exited or did not answer /health within {limit_s:g} s")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.05)
        healthy_s = time.perf_counter() - start
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
        httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=120).raise_for_status()
        fronts = spawned_children(proc.pid)
        status = Path(f"/proc/{fronts[0]}/status").read_text() if fronts else ""
        rss = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS")), None)
        torch = "libtorch" in Path(f"/proc/{fronts[0]}/maps").read_text() if fronts else None
        return {"healthy_s": round(healthy_s, 2), "front_end_rss_kb": rss, "front_end_torch": torch}
    finally:
        proc.terminate()
        proc.wait(60)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3, help="fresh servers to start (default 3)")
    ap.add_argument("--limit-s", type=float, default=300, help="seconds a server may take to answer /health")
    ap.add_argument("server_flags", nargs="*", help="flags for python -m server (after --)")
    args = ap.parse_args(argv)
    for rep in range(args.reps):
        print(f"rep {rep}: {one_start(args.server_flags, args.limit_s)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
