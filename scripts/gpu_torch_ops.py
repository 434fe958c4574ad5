"""The torch ops (not views) one eager decode round of one lane launches on the kernel path, counted by op and call
site: what is left for kernels to take over. Rank 0's half of tp=2 alone (collectives skipped), dummy weights.

python3 scripts/gpu_torch_ops.py [--model configs/qwen3.8-flash-next]            # on the GPU
TRITON_INTERPRET=1 python3 scripts/gpu_torch_ops.py --model CHECKPOINT --device cpu   # its weights, on the CPU
"""

from __future__ import annotations

import argparse
import random
import sys
import traceback
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]

from gpu_profile_round import decode_batch  # noqa: E402
from gpu_step_profile import collectives_skipped  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from model import kernel_path  # noqa: E402
from model.parallel import TensorParallel  # noqa: E402
from model.weights import load_model  # noqa: E402

# ops that launch nothing: views, allocations, scalars read back, and the interpreter's own tensor handling
SILENT = frozenset((
    "view", "_unsafe_view", "split", "split_with_sizes", "unflatten", "slice", "select", "unsqueeze", "squeeze",
    "expand", "t", "transpose", "permute", "as_strided", "alias", "detach", "chunk", "unbind", "narrow", "empty",
    "empty_strided", "empty_like", "new_empty", "lift_fresh", "reshape", "flatten", "is_same_size", "sym_size",
    "sym_stride", "sym_numel", "_local_scalar_dense", "item", "set_", "record_stream",
))  # fmt: skip
VOCAB = 120_000  # tokens are drawn below this


class OpSites(TorchDispatchMode):
    """Counts each torch op by name and its two innermost model/ or kernels/ call sites."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name not in SILENT:
            ours = (str(ROOT / "model"), str(ROOT / "kernels"))
            frames = [f for f in traceback.extract_stack() if f.filename.startswith(ours)][-2:]
            where = " < ".join(f"{Path(f.filename).parent.name}/{Path(f.filename).name}:{f.lineno}" for f in frames)
            self.sites[f"{name} @ {where}"] += 1
        return func(*args, **(kwargs or {}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / "configs/qwen3.8-flash-next", help="config or checkpoint")
    ap.add_argument("--device", default="cuda", help="cuda: dummy weights at tp=2; cpu: the checkpoint's, one rank")
    args = ap.parse_args(argv)
    on_gpu = args.device == "cuda"
    with collectives_skipped():
        model = load_model(
            args.model, device=args.device, dtype="bfloat16", tp=TensorParallel(0, 2) if on_gpu else None,
            load_format="dummy" if on_gpu else "auto", kernels="on",
        )  # fmt: skip
        kernel_path.lane_pool(model, slots=2, context=1024)
        lanes, rng, vocab = [model.new_lane()], random.Random(0), min(VOCAB, model.cfg.vocab_size)
        model(decode_batch(lanes, 16, vocab, rng))
        model(decode_batch(lanes, 1, vocab, rng))
        with OpSites() as ops:
            model(decode_batch(lanes, 1, vocab, rng))
    print(f"{sum(ops.sites.values())} torch ops in one lane's decode round, {len(model.layers)} layers")
    for site, count in ops.sites.most_common():
        print(f"{count:5d}  {site}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
