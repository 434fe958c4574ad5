"""Serve a tiny checkpoint on CPU and on the GPUs at --tp 1 and 2 and compare every request's tokens: across
servers, drafted against `"draft": false`, and eight concurrent requests against each alone.

python3 scripts/gpu_tp_check.py --out DIR        # writes DIR/tp_check.json and prints a table
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]

from make_checkpoint import make_checkpoint  # noqa: E402

from server.ranks import free_port  # noqa: E402

PROMPTS = ([7, 19, 40, 33, 2, 91, 12, 44], [100, 3, 5, 9, 250, 17], [42] * 12)


def run_server(ckpt: Path, device: str, tp: int, dtype: str, log: Path) -> dict[str, object]:
    """Start a server, send the requests, stop it; the tokens of every request."""
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "server",
        str(ckpt),
        "--device",
        device,
        "--tp",
        str(tp),
        "--dtype",
        dtype,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    with log.open("w") as sink:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT)
        url, results = f"http://127.0.0.1:{port}", {}
        try:
            deadline = time.monotonic() + 180
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited with {proc.returncode}; see {log}")
                try:
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("server did not come up")
                time.sleep(0.25)
            bodies = {}
            for i, prompt in enumerate(PROMPTS):
                for temperature, seed in ((0.0, None), (1.0, 1234 + i)):
                    body = {
                        "prompt": prompt,
                        "max_tokens": 32,
                        "temperature": temperature,
                        "ignore_eos": True,
                        "return_token_ids": True,
                    }
                    if seed is not None:
                        body["seed"] = seed
                    bodies[f"prompt{i}_T{temperature:g}"] = body
            for name, body in bodies.items():
                start = time.monotonic()
                out = httpx.post(f"{url}/v1/completions", json=body, timeout=300).json()
                seconds = round(time.monotonic() - start, 3)
                serial = httpx.post(f"{url}/v1/completions", json={**body, "draft": False}, timeout=300).json()
                results[name] = {
                    "token_sha": out["token_sha"],
                    "token_ids": out["choices"][0]["token_ids"],
                    "seconds": seconds,
                    "draft_false_same": serial["token_sha"] == out["token_sha"],
                }
            names = [*bodies, *list(bodies)[:2]]
            with ThreadPoolExecutor(len(names)) as pool:
                together = list(
                    pool.map(
                        lambda n: httpx.post(f"{url}/v1/completions", json=bodies[n], timeout=300).json()["token_sha"],
                        names,
                    )
                )
            results["concurrent_same_as_alone"] = sum(
                sha == results[n]["token_sha"] for n, sha in zip(names, together, strict=True)
            )
            results["concurrent_requests"] = len(names)
            results["health"] = httpx.get(f"{url}/health").json()
        finally:
            proc.terminate()
            try:
                results["exit_code"] = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                results["exit_code"] = "killed"
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON report and server logs")
    parser.add_argument("--config", type=Path, default=ROOT / "configs/tiny/base.json", help="tiny text config")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_checkpoint(json.loads(args.config.read_text()), Path(tmp) / "tiny", fmt="fp32", tokenizer=True)
        runs = {}
        for device, tp, dtype in (
            ("cpu", 1, "float32"),
            ("cpu", 2, "float32"),
            ("cuda", 1, "float32"),
            ("cuda", 2, "float32"),
            ("cuda", 2, "bfloat16"),
        ):
            name = f"{device}_tp{tp}_{dtype}"
            try:
                runs[name] = run_server(ckpt, device, tp, dtype, args.out / f"{name}.log")
            except Exception as exc:  # report every configuration, even one that failed
                runs[name] = {"error": str(exc)}
            print(name, "done", flush=True)
    reference = runs["cpu_tp1_float32"]
    report = {"runs": runs, "same_as_cpu_tp1": {}}
    for name, run in runs.items():
        keys = [k for k in reference if k.startswith("prompt")]
        report["same_as_cpu_tp1"][name] = {
            k: run.get(k, {}).get("token_sha") == reference[k]["token_sha"] for k in keys
        }
    (args.out / "tp_check.json").write_text(json.dumps(report, indent=1))
    ok = True
    for name, same in report["same_as_cpu_tp1"].items():
        run = runs[name]
        serial = sum(bool(v.get("draft_false_same")) for k, v in run.items() if k.startswith("prompt"))
        health = run.get("health", {})
        print(
            f"{name:22s} exit={run.get('exit_code', run.get('error'))} same tokens as cpu tp1: "
            f"{sum(same.values())}/{len(same)}; drafted = draft:false {serial}/{len(same)}; "
            f"concurrent = alone {run.get('concurrent_same_as_alone')}/{run.get('concurrent_requests')}; "
            f"drafts {health.get('draft_tokens')}, accepted {health.get('accepted_draft_tokens')}"
        )
        ok &= serial == len(same) and run.get("concurrent_same_as_alone") == run.get("concurrent_requests")
        ok &= not name.endswith("float32") or all(same.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
