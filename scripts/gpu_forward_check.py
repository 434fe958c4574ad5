"""GPU check of the model's kernel path (CUDA, bf16, --kernels on) on the shipped checkpoint and a tiny one made here:
greedy tokens and logits against the CPU reference path (bf16 and fp32), row invariance (each lane's bits alone =
among 2, 7 and 64 lanes = prefilled in chunks = inside verify windows, snapshots restoring the serial state, MTP rows),
and one round's time (CUDA events, median of warmed-up runs) against the reference path on the GPU.

python3 scripts/gpu_forward_check.py --out DIR   # DIR/forward_check.json and DIR/forward_check.log; exit 1 on a failure
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from model.flashnext import FlashNextModel, ForwardOutput  # noqa: E402
from model.layers import ForwardBatch, Segment  # noqa: E402
from model.shipped import SHIPPED_MODEL  # noqa: E402
from model.state import LaneState, copy_lane  # noqa: E402
from model.weights import load_model  # noqa: E402

log = logging.getLogger("gpu_forward_check")
LANE_COUNTS = (1, 2, 7, 64)
WINDOW = 4  # rows of a verify window: the pending token and three drafts
CHUNK = 3  # prompt tokens per lane and round in the chunked prefill
TINY_OVERRIDES = {"linear_key_head_dim": 16, "linear_value_head_dim": 16, "indexer_budget": 4}
TOLERANCE = 0.05  # logits' relative error against the fp32 reference that always passes
REFERENCES = {"bf16": "bfloat16", "fp32": "float32"}  # CPU reference paths the tokens are compared with
ROUNDS = {"1 lane": (1, 1), "1 lane, 4-row window": (1, WINDOW), "8 lanes": (8, 1), "64 lanes": (64, 1)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for forward_check.json and forward_check.log")
    ap.add_argument("--models", nargs="+", choices=("shipped", "tiny"), default=["shipped", "tiny"])
    ap.add_argument("--prompts", type=int, default=4, help="prompts whose greedy tokens are compared")
    ap.add_argument("--steps", type=int, default=8, help="greedy tokens per prompt")
    ap.add_argument("--reps", type=int, default=10, help="timed runs per round (median reported)")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def prompts(count: int, vocab: int, seed: int, shortest: int = 5, longest: int = 24) -> list[list[int]]:
    """`count` random prompts of varied lengths, every fifth token a low id (eos-like ids restart the n-gram hash)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        length = shortest + (i * 7) % (longest - shortest + 1)
        ids = torch.randint(0, vocab, (length,), generator=gen).tolist()
        out.append([t if k % 5 else t % 8 for k, t in enumerate(ids)])
    return out


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (the shorter length if one is a prefix of the other), None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error of a against b, in fp64 on the CPU."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).norm() / b.norm()).item()


def fold(model: FlashNextModel, parts: list[tuple[LaneState, list[int]]], snap: bool = False) -> ForwardOutput:
    """One forward of each lane's next tokens (segments in the given order); snapshots of every segment if asked."""
    tokens, positions, segments = [], [], []
    for lane, ids in parts:
        segments.append(Segment(lane, len(tokens), len(ids)))
        tokens.extend(ids)
        positions.extend(range(lane.length, lane.length + len(ids)))
    device = model.device
    batch = ForwardBatch(torch.tensor(tokens, device=device), torch.tensor(positions, device=device), segments)
    return model(batch, snapshot_rows={i: range(seg.length) for i, seg in enumerate(segments)} if snap else None)


def state_diff(a: LaneState, b: LaneState) -> str | None:
    """The first part in which two lane states differ (bits), None when they hold the same state."""
    if a.length != b.length:
        return "length"
    if not torch.equal(a.ngram_history, b.ngram_history):
        return "ngram_history"
    for name in ("gdn_conv", "gdn_recurrent", "ple_conv"):
        x, y = getattr(a, name), getattr(b, name)
        if x.keys() != y.keys() or not all(torch.equal(x[i], y[i]) for i in x):
            return name
    for i, cache in a.attention.items():
        other = b.attention[i]
        for field in ("keys", "values", "index_keys"):
            if not torch.equal(getattr(cache, field)[: a.length], getattr(other, field)[: a.length]):
                return f"attention[{i}].{field}"
    return None


def greedy(model: FlashNextModel, prompt: list[int], steps: int) -> tuple[torch.Tensor, list[int]]:
    """The prompt's logits (fp32, CPU) and `steps` greedy tokens after it, ties to the lower id."""
    lane = model.new_lane()
    logits = fold(model, [(lane, prompt)]).logits
    first, tokens = logits.float().cpu(), []
    for _ in range(steps):
        tokens.append(int(logits[-1].float().argmax()))
        logits = fold(model, [(lane, tokens[-1:])]).logits
    return first, tokens


def accuracy(ker: FlashNextModel, refs: dict[str, FlashNextModel], texts: list[list[int]], steps: int) -> dict:
    """Greedy tokens and prompt logits of the kernel path against the CPU references `bf16` and `fp32`; gated on the
    logits' error from fp32's: at most TOLERANCE, or twice the bf16 reference's own if that is larger."""
    rows, failures = [], []
    for i, prompt in enumerate(texts):
        logits, tokens = greedy(ker, prompt, steps)
        row = {"prompt": i, "length": len(prompt), "tokens": tokens}
        outs = {name: greedy(ref, prompt, steps) for name, ref in refs.items()}
        for name, (ref_logits, ref_tokens) in outs.items():
            row[name] = {"tokens": ref_tokens, "diverges_at": first_divergence(tokens, ref_tokens)}
            row[name]["logits_rel_err"] = rel_err(logits, ref_logits)
        bound = max(TOLERANCE, 2 * rel_err(outs["bf16"][0], outs["fp32"][0]))
        row["bound"] = bound
        if row["fp32"]["logits_rel_err"] > bound:
            failures.append(f"prompt {i}: logits {row['fp32']['logits_rel_err']:.4f} from fp32's > {bound:.4f}")
        rows.append(row)
        log.info("accuracy prompt %d (%d tokens): %s", i, len(prompt), json.dumps(row))
    return {"prompts": rows, "failures": failures}


def invariance(ker: FlashNextModel, texts: list[list[int]]) -> dict:
    """Each lane's bits: prefill alone = batched = chunked; a decode row and a verify window's rows alone = among
    1, 2, 7, 64 lanes = folded serially; a window's snapshot = the serial state; MTP rows alone = batched."""
    failures: list[str] = []
    lanes = len(texts)
    solo_lanes, solo = [], []
    for prompt in texts:
        lane = ker.new_lane()
        solo.append(fold(ker, [(lane, prompt)]).hidden)
        solo_lanes.append(lane)
    batched_lanes = [ker.new_lane() for _ in texts]
    out = fold(ker, [(batched_lanes[i], texts[i]) for i in reversed(range(lanes))])
    start = 0
    for i in reversed(range(lanes)):
        if not torch.equal(out.hidden[start : start + len(texts[i])], solo[i]):
            failures.append(f"prefill: lane {i} batched with {lanes} lanes differs from alone")
        start += len(texts[i])
    chunked_lanes = [ker.new_lane() for _ in texts]
    chunked: list[list[torch.Tensor]] = [[] for _ in texts]
    for offset in range(0, max(map(len, texts)), CHUNK):
        live = [i for i in range(lanes) if offset < len(texts[i])]
        out = fold(ker, [(chunked_lanes[i], texts[i][offset : offset + CHUNK]) for i in live])
        start = 0
        for i in live:
            rows = len(texts[i][offset : offset + CHUNK])
            chunked[i].append(out.hidden[start : start + rows])
            start += rows
    for i in range(lanes):
        if not torch.equal(torch.cat(chunked[i]), solo[i]):
            failures.append(f"prefill: lane {i} in chunks of {CHUNK} differs from whole")
        if (part := state_diff(chunked_lanes[i], solo_lanes[i])) is not None:
            failures.append(f"prefill: lane {i}'s state after chunks differs in {part}")
    vocab = ker.cfg.vocab_size
    windows = [[(13 * i + 11) % vocab, *texts[i][: WINDOW - 1]] for i in range(lanes)]  # pending token, then drafts
    serial, serial_states = [], []
    for i in range(lanes):
        lane, rows, states = copy_lane(solo_lanes[i]), [], []
        for token in windows[i]:
            rows.append(fold(ker, [(lane, [token])]).logits)
            states.append(copy_lane(lane))
        serial.append(torch.cat(rows))
        serial_states.append(states)
    for count in (c for c in LANE_COUNTS if c <= lanes):
        copies = [copy_lane(solo_lanes[i]) for i in range(count)]
        out = fold(ker, [(copies[i], windows[i][:1]) for i in range(count)])
        for i in range(count):
            if not torch.equal(out.logits[i], serial[i][0]):
                failures.append(f"decode: lane {i} among {count} lanes differs from alone")
        copies = [copy_lane(solo_lanes[i]) for i in range(count)]
        out = fold(ker, [(copies[i], windows[i]) for i in range(count)], snap=True)
        for i in range(count):
            if not torch.equal(out.logits[i * WINDOW : (i + 1) * WINDOW], serial[i]):
                failures.append(f"window: lane {i}'s {WINDOW} rows among {count} lanes differ from serial rows")
        ker.restore_lanes([(copies[i], out.snapshots[i][i % WINDOW]) for i in range(count)])  # as the runner does
        for i in range(count):
            kept = i % WINDOW
            if (part := state_diff(copies[i], serial_states[i][kept])) is not None:
                failures.append(f"window: lane {i} among {count} restored after row {kept} differs in {part}")
        nxt = fold(ker, [(copies[i], [3]) for i in range(count)]).logits
        for i in range(count):
            expect = fold(ker, [(copy_lane(serial_states[i][i % WINDOW]), [3])]).logits[0]
            if not torch.equal(nxt[i], expect):
                failures.append(f"window: lane {i} among {count}, the row after a restore differs from serial")
    if ker.mtp is not None:
        failures += mtp_invariance(ker, texts, solo)
    for failure in failures:
        log.error("invariance: %s", failure)
    return {"lanes": lanes, "failures": failures}


def mtp_invariance(ker: FlashNextModel, texts: list[list[int]], solo: list[torch.Tensor]) -> list[str]:
    """The MTP layer's rows of each lane alone and all lanes batched: bit-identical logits and wide states."""

    def run(indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, positions, segments, hidden = [], [], [], []
        for i in indices:
            ids = texts[i][1:]
            segments.append(Segment(ker.new_lane(), len(tokens), len(ids)))
            tokens.extend(ids)
            positions.extend(range(len(ids)))
            hidden.append(solo[i][:-1])
        device = ker.device
        batch = ForwardBatch(torch.tensor(tokens, device=device), torch.tensor(positions, device=device), segments)
        return ker.mtp_forward(batch, torch.cat(hidden))

    failures = []
    logits, wide = run(list(range(len(texts))))
    start = 0
    for i in range(len(texts)):
        alone_logits, alone_wide = run([i])
        rows = len(texts[i]) - 1
        if not (
            torch.equal(logits[start : start + rows], alone_logits)
            and torch.equal(wide[start : start + rows], alone_wide)
        ):
            failures.append(f"mtp: lane {i}'s rows among {len(texts)} lanes differ from alone")
        start += rows
    return failures


def round_ms(model: FlashNextModel, base: list[LaneState], tokens: list[list[int]], snap: bool, reps: int) -> float:
    """Median ms of one round (CUDA events around the forward), from copies of the same lane states each run."""
    times = []
    for rep in range(reps + 3):
        lanes = [copy_lane(lane) for lane in base]
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fold(model, list(zip(lanes, tokens, strict=True)), snap=snap)
        end.record()
        end.synchronize()
        if rep >= 3:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def timing(models: dict[str, FlashNextModel], texts: list[list[int]], reps: int) -> dict:
    """One round's median time per path: 1 lane, 1 lane with a verify window, 8 and 64 lanes (one row each)."""
    out: dict[str, dict[str, float]] = {}
    for path, model in models.items():
        base = []
        for prompt in texts:
            lane = model.new_lane()
            fold(model, [(lane, prompt)])
            base.append(lane)
        for name, (count, rows) in ROUNDS.items():
            tokens = [[*texts[i][:rows]] for i in range(count)]
            ms = round_ms(model, base[:count], tokens, rows > 1, reps)
            out.setdefault(name, {})[path] = ms
            log.info("timing %s, %s path: %.3f ms", name, path, ms)
    return out


def tiny_checkpoint(folder: Path) -> Path:
    """A tiny bf16 checkpoint (BF16 expert bank) with GDN head dims the kernels take, written here."""
    from make_checkpoint import make_checkpoint

    text = {**json.loads((ROOT / "configs" / "tiny" / "base.json").read_text()), **TINY_OVERRIDES}
    return make_checkpoint(text, folder / "tiny-bf16", fmt="bf16")


def check_model(name: str, path: Path, args: argparse.Namespace, report: dict, write) -> None:
    """Accuracy, invariance and timing of one checkpoint, each section recorded (or its error) as it ends."""
    entry = report["models"].setdefault(name, {"path": str(path)})
    ker = load_model(path, device="cuda", dtype="bfloat16", kernels="on")
    vocab = ker.cfg.vocab_size
    texts = prompts(max(LANE_COUNTS), vocab, args.seed)
    sections = {
        "accuracy": lambda: accuracy(
            ker,
            {n: load_model(path, device="cpu", dtype=d, kernels="off") for n, d in REFERENCES.items()},
            texts[: args.prompts],
            args.steps,
        ),
        "invariance": lambda: invariance(ker, texts),
        "timing": lambda: timing(
            {"kernels": ker, "reference": load_model(path, device="cuda", dtype="bfloat16", kernels="off")},
            texts,
            args.reps,
        ),
    }
    for section, run in sections.items():
        began = time.monotonic()
        try:
            result = run()
        except Exception:
            result = {"error": traceback.format_exc(), "failures": [f"{section} raised"]}
            log.error("%s %s raised:\n%s", name, section, result["error"])
        result["seconds"] = round(time.monotonic() - began, 1)
        entry[section] = result
        report["failures"] += [f"{name}: {f}" for f in result.get("failures", [])]
        write()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(message)s",
        handlers=[logging.StreamHandler(sys.stdout), logging.FileHandler(args.out / "forward_check.log", mode="w")],
    )
    if not torch.cuda.is_available():
        log.error("no CUDA device: this check runs the kernel path on a GPU")
        return 2
    import triton

    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "models": {},
        "failures": [],
    }

    def write() -> None:
        (args.out / "forward_check.json").write_text(json.dumps(report, indent=2))

    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            try:
                path = SHIPPED_MODEL if name == "shipped" else tiny_checkpoint(Path(tmp))
                check_model(name, path, args, report, write)
            except Exception:
                report["models"][name] = {"error": traceback.format_exc()}
                report["failures"].append(f"{name}: could not be checked")
                log.error("%s could not be checked:\n%s", name, report["models"][name]["error"])
            write()
    log.info("%d failure(s)%s", len(report["failures"]), "".join(f"\n  {f}" for f in report["failures"]))
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
