"""Evaluate a small trained Flash Next: held-out loss and accuracy through our own forward, and through a running
server the MTP acceptance per draft position and drafted against `"draft": false` speed (with, per stream count,
whether every output equals the first stream count's: concurrent = solo).

python scripts/eval_small.py offline --data build/small/data --model model/checkpoints/flashnext-small
python scripts/eval_small.py serve --data build/small/data --base-url http://127.0.0.1:8000 --streams 1,8
"""

from __future__ import annotations

import argparse
import json
import math
import re
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
import torch.nn.functional as F

SPLITS = ("eval_code", "eval_chat")
DOCUMENT_END = "<|endoftext|>"
DRAFTED, ACCEPTED = (
    "spec_decode_num_draft_tokens_per_pos",
    "spec_decode_num_accepted_tokens_per_pos",
)  # the corpus ends every document with it
TURN = re.compile(r"<\|im_start\|>(system|user|assistant)\n(.*?)<\|im_end\|>", re.S)
EMPTY_THINK = re.compile(r"^<think>\s*</think>\s*", re.S)


def read_tokens(data: Path, split: str) -> np.ndarray:
    """A split's token ids (little-endian uint16)."""
    return np.fromfile(data / f"{split}.bin", dtype="<u2").astype(np.int64)


def documents(tokens: np.ndarray, eos: int) -> list[np.ndarray]:
    """The documents of a split, each without its trailing eos."""
    ends = np.flatnonzero(tokens == eos)
    starts = np.concatenate(([0], ends[:-1] + 1))
    return [tokens[s:e] for s, e in zip(starts, ends, strict=True) if e > s]


def windows(tokens: np.ndarray, count: int, length: int) -> list[np.ndarray]:
    """`count` windows of `length` tokens at evenly spaced offsets of the split (deterministic)."""
    last = len(tokens) - length
    if last < 0:
        raise ValueError(f"the split holds {len(tokens)} tokens, fewer than one window of {length}")
    return [tokens[o : o + length] for o in np.linspace(0, last, count).astype(np.int64)]


def score_window(model, window: np.ndarray) -> dict[str, float]:
    """Summed losses and hit counts of the trunk (t+1) and the MTP (t+2), teacher-forced, over one window."""
    from model.flashnext import single_lane_batch

    ids = torch.as_tensor(window, device=model.device)
    out = model(single_lane_batch(model.new_lane(), ids, 0))
    trunk = out.logits[:-1].float()
    figures = {
        "trunk_loss": F.cross_entropy(trunk, ids[1:], reduction="sum").item(),
        "trunk_hits": (trunk.argmax(-1) == ids[1:]).sum().item(),
        "trunk_rows": len(window) - 1,
    }
    if model.mtp is not None:
        rows = single_lane_batch(model.new_lane(), ids[1:-1], 0)
        mtp, _ = model.mtp_forward(rows, out.hidden[:-2])
        mtp = mtp.float()
        figures.update(
            mtp_loss=F.cross_entropy(mtp, ids[2:], reduction="sum").item(),
            mtp_hits=(mtp.argmax(-1) == ids[2:]).sum().item(),
            mtp_agree=(mtp.argmax(-1) == trunk[1:].argmax(-1)).sum().item(),
            mtp_rows=len(window) - 2,
        )
    return figures


def offline(args: argparse.Namespace) -> dict[str, Any]:
    """Held-out loss, next-token accuracy and MTP agreement with the trunk, through our own loader and forward."""
    from model.weights import load_model

    model = load_model(Path(args.model), device=args.device, dtype=args.dtype)
    report: dict[str, Any] = {"model": args.model, "windows": args.windows, "seq": args.seq}
    for split in SPLITS:
        totals: dict[str, float] = {}
        for window in windows(read_tokens(Path(args.data), split), args.windows, args.seq):
            for key, value in score_window(model, window).items():
                totals[key] = totals.get(key, 0) + value
        figures = {
            "trunk_loss": totals["trunk_loss"] / totals["trunk_rows"],
            "trunk_accuracy": totals["trunk_hits"] / totals["trunk_rows"],
        }
        if "mtp_rows" in totals:
            figures.update(
                mtp_loss=totals["mtp_loss"] / totals["mtp_rows"],
                mtp_accuracy=totals["mtp_hits"] / totals["mtp_rows"],
                mtp_agreement_with_trunk=totals["mtp_agree"] / totals["mtp_rows"],
            )
        figures["trunk_perplexity"] = math.exp(figures["trunk_loss"])
        report[split] = figures
        print(split, json.dumps(figures), flush=True)
    return report


def chat_messages(text: str) -> list[dict[str, str]]:
    """The turns of a rendered chat document before its last assistant turn (the prompt a client would send)."""
    turns = [(role, EMPTY_THINK.sub("", body)) for role, body in TURN.findall(text)]
    while turns and turns[-1][0] == "assistant":
        turns.pop()
    if not turns:
        raise ValueError("a chat document holds no user turn")
    return [{"role": role, "content": body} for role, body in turns]


def request_bodies(args: argparse.Namespace, split: str, tokenizer) -> list[dict[str, Any]]:
    """Held-out prompts as request bodies: code windows as token ids, chat documents as messages."""
    tokens = read_tokens(Path(args.data), split)
    common = {"max_tokens": args.tokens, "temperature": 0, "ignore_eos": split == "eval_code"}
    if split == "eval_code":
        picked = windows(tokens, args.prompts, args.prompt_tokens)
        return [{"path": "completions", "prompt": [int(t) for t in w], **common} for w in picked]
    docs = documents(tokens, tokenizer.convert_tokens_to_ids(DOCUMENT_END))
    picked = [docs[int(i)] for i in np.linspace(0, len(docs) - 1, args.prompts).astype(np.int64)]
    text = [tokenizer.decode(doc.tolist(), skip_special_tokens=False) for doc in picked]
    return [{"path": "chat/completions", "messages": chat_messages(t), **common} for t in text]


def post(client: httpx.Client, base: str, body: dict[str, Any], draft: bool) -> dict[str, Any]:
    """One non-streamed request; the response JSON (raises on an HTTP error)."""
    payload = {k: v for k, v in body.items() if k != "path"} | {"draft": draft}
    response = client.post(f"{base}/v1/{body['path']}", json=payload)
    response.raise_for_status()
    return response.json()


def run_level(client: httpx.Client, base: str, bodies: list[dict[str, Any]], streams: int, draft: bool) -> dict:
    """Send the bodies `streams` at a time; aggregate completion tok/s and every output's token_sha."""
    shas: list[str | None] = [None] * len(bodies)
    tokens = [0] * len(bodies)

    def worker(indices: list[int]) -> None:
        with httpx.Client(timeout=client.timeout) as own:
            for i in indices:
                out = post(own, base, bodies[i], draft)
                shas[i], tokens[i] = out["token_sha"], out["usage"]["completion_tokens"]

    threads = [threading.Thread(target=worker, args=(list(range(s, len(bodies), streams)),)) for s in range(streams)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    return {
        "streams": streams,
        "draft": draft,
        "tokens": sum(tokens),
        "seconds": wall,
        "tok_s": sum(tokens) / wall,
        "shas": shas,
    }


def serve(args: argparse.Namespace) -> dict[str, Any]:
    """MTP acceptance per draft position (greedy) on held-out code and chat, and drafted vs undrafted speed."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(Path(args.data) / "tokenizer"))
    base = args.base_url.rstrip("/")
    report: dict[str, Any] = {"base_url": base, "prompts": args.prompts, "tokens": args.tokens}
    with httpx.Client(timeout=args.timeout) as client:
        for split in SPLITS:
            bodies = request_bodies(args, split, tokenizer)
            before = client.get(f"{base}/metrics").text
            drafted_run = run_level(client, base, bodies, 1, True)
            per_position = per_position_delta(before, client.get(f"{base}/metrics").text)
            plain_run = run_level(client, base, bodies, 1, False)
            report[split] = {
                "acceptance_per_position": per_position,
                "draft_tokens": sum(row["drafted"] for row in per_position),
                "accepted_tokens": sum(row["accepted"] for row in per_position),
                "drafted_equals_undrafted": drafted_run["shas"] == plain_run["shas"],
            }
            print(split, json.dumps(report[split]), flush=True)
        bodies = request_bodies(args, "eval_code", tokenizer)
        speed, solo = [], {}
        for streams in args.streams:
            for draft in (False, True):
                level = run_level(client, base, bodies, streams, draft)
                solo.setdefault(draft, level["shas"])  # the first level's outputs, every level compared with them
                speed.append({k: v for k, v in level.items() if k != "shas"})
                speed[-1]["equals_first_level"] = level["shas"] == solo[draft]
                print(json.dumps(speed[-1]), flush=True)
        report["speed"] = speed
    return report


def per_position_delta(before: str, after: str) -> list[dict[str, float]]:
    """Drafted and accepted counts per position between two /metrics scrapes, and their ratio."""

    def counts(text: str, name: str) -> dict[int, float]:
        pattern = re.compile(rf'^flashnext:{name}_total\{{(?:[^}}]*,)?position="(\d+)"[^}}]*\}} (\S+)$', re.M)
        return {int(p): float(v) for p, v in pattern.findall(text)}

    def delta(name: str) -> dict[int, float]:
        earlier = counts(before, name)
        return {p: n - earlier.get(p, 0) for p, n in counts(after, name).items()}

    drafted, accepted = delta(DRAFTED), delta(ACCEPTED)
    rows = []
    for position in sorted(drafted):
        kept = accepted.get(position, 0)
        rows.append(
            {
                "position": position,
                "drafted": drafted[position],
                "accepted": kept,
                "acceptance": kept / drafted[position] if drafted[position] else None,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    off = sub.add_parser("offline", help="held-out loss and accuracy through our loader and forward")
    off.add_argument("--data", required=True, help="the corpus folder (eval_code.bin, eval_chat.bin)")
    off.add_argument("--model", required=True, help="the checkpoint folder")
    off.add_argument("--windows", type=int, default=16, help="windows per split (default: %(default)s)")
    off.add_argument("--seq", type=int, default=256, help="tokens per window (default: %(default)s)")
    off.add_argument("--device", default="cpu", help="torch device (default: %(default)s)")
    off.add_argument("--dtype", default="float32", help="compute dtype (default: %(default)s)")
    on = sub.add_parser("serve", help="acceptance per draft position and drafted speed through a running server")
    on.add_argument("--data", required=True, help="the corpus folder (its eval bins and tokenizer/)")
    on.add_argument("--base-url", default="http://127.0.0.1:8000", help="server address (default: %(default)s)")
    on.add_argument("--prompts", type=int, default=8, help="held-out prompts per split (default: %(default)s)")
    on.add_argument("--prompt-tokens", type=int, default=128, help="tokens per code prompt (default: %(default)s)")
    on.add_argument("--tokens", type=int, default=64, help="completion tokens per request (default: %(default)s)")
    on.add_argument(
        "--streams",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 8],
        help="concurrency levels of the speed runs (default: 1,8)",
    )
    on.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default: %(default)s)")
    for p in (off, on):
        p.add_argument("--json", help="write the report to this file")
    args = parser.parse_args(argv)
    report = offline(args) if args.command == "offline" else serve(args)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
