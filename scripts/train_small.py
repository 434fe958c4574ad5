"""Train a small Flash Next (transformers' trunk plus the MTP layer), evaluate it, and save BF16 and NVFP4 checkpoints.

python scripts/train_small.py --data build/small/data --config configs/small/flashnext-small.json \
    --out build/small/run --minutes 6

The data folder holds train.bin, eval_code.bin and eval_chat.bin (little-endian uint16 token ids, each document
followed by eos), manifest.json (vocab_size, eos_token_id) and tokenizer/ (tokenizer.json, tokenizer_config.json,
chat_template.jinja). Windows are drawn across document boundaries: attention is plain causal over a window, and eos
resets the PLE n-gram hash inside the model. The MTP loss reaches the trunk (its hidden input is not detached).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shutil
import sys
import tempfile
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from safetensors import safe_open
from torch import nn
from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextModel
from transformers.models.qwen4_exp.modeling_qwen4_exp import (
    Qwen4ExpTextQSAIndexer,
    Qwen4ExpTextRMSNorm,
    apply_rotary_pos_emb,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))

from make_checkpoint import hf_text_config, write_generation_config, write_safetensors
from quantize_nvfp4 import convert_checkpoint

log = logging.getLogger("train_small")

EVAL_SPLITS = ("code", "chat")
EVAL_WINDOWS = 64
LOG_EVERY = 20
WARMUP = 0.05  # of the training budget
MIN_LR = 0.1  # of the peak, where the cosine ends
FILE_LIMIT = 16_000_000  # bytes per checkpoint file
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def read_tokens(path: Path) -> torch.Tensor:
    """A file of little-endian uint16 token ids, read whole."""
    size = path.stat().st_size
    if size % 2:
        raise ValueError(f"{path}: {size} bytes is not a whole number of uint16 token ids")
    return torch.from_file(str(path), shared=False, size=size // 2, dtype=torch.uint16)


def windows(tokens: torch.Tensor, starts: list[int], length: int) -> torch.Tensor:
    """Windows [len(starts), length] of token ids as int64."""
    if tokens.numel() < length:
        raise ValueError(f"{tokens.numel()} tokens cannot fill one window of {length}")
    return torch.stack([tokens[s : s + length] for s in starts]).long()


def tokenizer_specials(folder: Path) -> dict[str, int]:
    """The added (special) tokens of tokenizer.json: content -> id."""
    added = json.loads((folder / "tokenizer.json").read_text()).get("added_tokens", [])
    return {token["content"]: token["id"] for token in added}


def check_data(data: Path, text: dict[str, Any]) -> dict[str, int]:
    """Refuse a config whose vocab_size or eos_token_id disagrees with the data; return the tokenizer's specials."""
    manifest = json.loads((data / "manifest.json").read_text())
    for key in ("vocab_size", "eos_token_id"):
        if manifest.get(key) != text[key]:
            raise ValueError(f"{key}: the config says {text[key]}, {data / 'manifest.json'} says {manifest.get(key)}")
    specials = tokenizer_specials(data / "tokenizer")
    if specials.get("<|endoftext|>") != text["eos_token_id"]:
        raise ValueError(
            f"eos_token_id: the config says {text['eos_token_id']}, the tokenizer's <|endoftext|> is "
            f"{specials.get('<|endoftext|>')}"
        )
    return specials


def select_tokens(
    self: Qwen4ExpTextQSAIndexer,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor,
    cache: object | None = None,
) -> torch.Tensor:
    """A QSA indexer's selection [B, 1, T, T] over whole causal windows, vectorised over the queries (transformers
    loops over them): the top blocks by score, ties to the lower block as our reference picks them, plus the tail."""
    if cache is not None:
        raise ValueError("the training indexer selects over whole windows; it keeps no cache")
    b, t, _ = hidden_states.shape
    heads, dim, ratio = self.index_n_heads, self.index_head_dim, self.compress_ratio
    cos, sin = position_embeddings
    q, raw = self.index_qk_proj(hidden_states).split([heads * dim, dim], dim=-1)
    q = apply_rotary_pos_emb(self.q_layernorm(q.unflatten(-1, (heads, dim))), cos=cos, sin=sin, unsqueeze_dim=2)
    blocks = t // ratio
    pooled = raw[:, : blocks * ratio].unflatten(1, (blocks, ratio)).float().mean(2).to(raw.dtype)
    first = torch.arange(blocks, device=raw.device) * ratio
    keys = apply_rotary_pos_emb(
        self.k_layernorm(pooled).unsqueeze(2), cos=cos[:, first], sin=sin[:, first], unsqueeze_dim=2
    ).squeeze(2)
    with torch.autocast(raw.device.type, enabled=False):  # scores in fp32, as the model defines them
        scores = torch.einsum("bqhd,bkd->bqkh", q.float(), keys.float()).relu().sum(-1) / math.sqrt(dim)
    ends = torch.arange(1, t + 1, device=raw.device)  # tokens visible to each query
    complete = (first + ratio)[None, :] <= ends[:, None]
    order = torch.sort(scores.masked_fill(~complete, -math.inf), dim=-1, descending=True, stable=True).indices
    top = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, order[..., : self.block_topk], True) & complete
    token = torch.arange(t, device=raw.device)
    picked = torch.cat((top, top.new_zeros(b, t, 1)), dim=-1)[..., (token // ratio).clamp_max(blocks)]
    tail = token[None, :] >= (ends // ratio * ratio)[:, None]
    causal = token[None, :] < ends[:, None]
    return ((picked | tail) & causal).unsqueeze(1) & attention_mask


def use_training_kernels(model: nn.Module) -> None:
    """sdpa attention, the per-expert loop (grouped_mm wants bf16 weights, ours are fp32) and the vectorised indexer."""
    model.set_attn_implementation("sdpa")
    model.set_experts_implementation("eager")
    for module in model.modules():
        if isinstance(module, Qwen4ExpTextQSAIndexer):
            module.forward = types.MethodType(select_tokens, module)


class MTPLayer(nn.Module):
    """The MTP layer for training: fc of the normed embedding of token t+1 plus fc of each stream of the trunk's
    normed wide state at t (one RMS over all streams), transformers' QSA decoder layer at position t, its own mixer.
    Its state_dict names are the released checkpoint's, less the `mtp.` prefix."""

    def __init__(self, text: dict[str, Any]) -> None:
        super().__init__()
        one = {k: v for k, v in text.items() if k not in ("layer_types", "ple_layer_ids")}
        one.update(num_hidden_layers=1, full_attention_interval=1)
        config = hf_text_config(one)
        donor = Qwen4ExpTextModel(config)  # transformers' initialisation of the layer and the mixer
        use_training_kernels(donor)
        self.layers, self.rotary_emb = donor.layers, donor.rotary_emb
        self.hyper_connection_mixer = donor.hyper_connection_mixer
        d, self.hc = config.hidden_size, config.hc_count
        self.fc_embedding = nn.Linear(d, d, bias=False)
        self.fc_hidden = nn.Linear(d, d, bias=False)
        for fc in (self.fc_embedding, self.fc_hidden):
            nn.init.normal_(fc.weight, std=config.initializer_range)
        self.pre_fc_norm_embedding = Qwen4ExpTextRMSNorm(d, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = Qwen4ExpTextRMSNorm(d * self.hc, eps=config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, next_embeds: torch.Tensor) -> torch.Tensor:
        """Mixed output [B, T, d] for the lm_head, from rows (wide state at t, embedding of token t+1) at position t."""
        u = self.fc_embedding(self.pre_fc_norm_embedding(next_embeds))
        streams = self.pre_fc_norm_hidden(hidden).unflatten(-1, (self.hc, -1))
        wide = (self.fc_hidden(streams) + u.unsqueeze(-2)).flatten(-2)
        b, t = wide.shape[:2]
        positions = torch.arange(t, device=wide.device).expand(3, b, t)
        causal = torch.ones(t, t, dtype=torch.bool, device=wide.device).tril().expand(b, 1, t, t)
        wide = self.layers[0](wide, position_embeddings=self.rotary_emb(wide, positions), attention_mask=causal)
        return self.hyper_connection_mixer(wide)


class SmallFlashNext(nn.Module):
    """transformers' Qwen4ExpForCausalLM trunk and the MTP layer, which shares its embed_tokens and lm_head."""

    def __init__(self, text: dict[str, Any]) -> None:
        super().__init__()
        self.trunk = Qwen4ExpForCausalLM(hf_text_config(text))
        use_training_kernels(self.trunk)
        self.mtp = MTPLayer(text)
        self.pre_mixer: torch.Tensor | None = None
        self.trunk.model.hyper_connection_mixer.register_forward_pre_hook(self._keep_pre_mixer)

    def _keep_pre_mixer(self, _module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        """The trunk's wide residual after the last layer's MoE write-back, the MTP layer's hidden input."""
        self.pre_mixer = args[0]

    def forward(self, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Trunk logits for window[:, 1:-1] and MTP logits for window[:, 2:] from inputs window[:, :-2], and the
        router load-balancing loss (training only)."""
        out = self.trunk(input_ids=window[:, :-2], use_cache=False, output_router_logits=self.training)
        mixed = self.mtp(self.pre_mixer, self.trunk.model.embed_tokens(window[:, 1:-1]))
        return out.logits, self.trunk.lm_head(mixed), out.aux_loss


def parameter_counts(model: SmallFlashNext) -> dict[str, int]:
    """Parameters of the trunk (its routed experts and n-gram table among them) and of the MTP layer."""
    named = dict(model.trunk.named_parameters())
    return {
        "trunk": sum(p.numel() for p in named.values()),
        "trunk_experts": sum(p.numel() for n, p in named.items() if ".experts." in n),
        "trunk_ngram_table": sum(p.numel() for n, p in named.items() if "ngram_embedding" in n),
        "mtp": sum(p.numel() for p in model.mtp.parameters()),
    }


@dataclass(slots=True)
class Budget:
    """Training ends after `steps` steps or `seconds` of training, whichever comes first; the LR schedule follows
    whichever is further along, so it completes either way."""

    steps: int | None
    seconds: float | None

    def progress(self, steps: int, elapsed: float) -> float:
        by_steps = steps / self.steps if self.steps else 0.0
        by_time = elapsed / self.seconds if self.seconds else 0.0
        return min(1.0, max(by_steps, by_time))


def lr_scale(progress: float) -> float:
    """Linear warmup over the first WARMUP of training, then a cosine down to MIN_LR of the peak."""
    if progress < WARMUP:
        return progress / WARMUP
    cosine = 0.5 * (1 + math.cos(math.pi * (progress - WARMUP) / (1 - WARMUP)))
    return MIN_LR + (1 - MIN_LR) * cosine


def make_optimizer(model: nn.Module, lr: float, device: torch.device) -> torch.optim.AdamW:
    """AdamW, weight decay on matrices only (not on norms, biases, A_log or dt_bias)."""
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=device.type == "cuda")


def autocast(device: torch.device) -> torch.autocast:
    """bf16 autocast on CUDA (fp32 master weights), plain fp32 on the CPU."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def losses(model: SmallFlashNext, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Trunk CE (token t+1), MTP CE (token t+2) and the router load-balancing loss of one batch of windows."""
    trunk_logits, mtp_logits, aux = model(window)
    trunk = F.cross_entropy(trunk_logits.flatten(0, 1).float(), window[:, 1:-1].flatten())
    mtp = F.cross_entropy(mtp_logits.flatten(0, 1).float(), window[:, 2:].flatten())
    return trunk, mtp, aux


def train_step(
    model: SmallFlashNext, optimizer: torch.optim.Optimizer, window: torch.Tensor, mtp_weight: float
) -> torch.Tensor:
    """One optimiser step on a batch of windows; the trunk and MTP losses (detached, on the device)."""
    with autocast(window.device):
        trunk_loss, mtp_loss, aux = losses(model, window)
    (trunk_loss + mtp_weight * mtp_loss + model.trunk.config.router_aux_loss_coef * aux).backward()
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return torch.stack((trunk_loss.detach(), mtp_loss.detach()))


def train(model: SmallFlashNext, tokens: torch.Tensor, args: argparse.Namespace, device: torch.device) -> dict:
    """Train on seeded random windows until the budget ends; the step count, tokens, time and loss curve."""
    optimizer = make_optimizer(model, args.lr, device)
    budget = Budget(args.steps, args.minutes * 60 if args.minutes else None)
    generator = torch.Generator().manual_seed(args.seed)
    length, tokens_per_step = args.seq + 2, args.batch * args.seq
    curve: list[dict[str, float]] = []
    sums, since, last = torch.zeros(2, device=device), 0, 0.0
    step, start, finished = 0, time.perf_counter(), False
    model.train()
    while not finished:
        for group in optimizer.param_groups:
            group["lr"] = args.lr * lr_scale(budget.progress(step + 1, time.perf_counter() - start))
        starts = torch.randint(0, tokens.numel() - length + 1, (args.batch,), generator=generator).tolist()
        sums += train_step(model, optimizer, windows(tokens, starts, length).to(device), args.mtp_weight)
        step, since, now = step + 1, since + 1, time.perf_counter() - start
        finished = budget.progress(step, now) >= 1.0
        if step == 1 or step % LOG_EVERY == 0 or finished:
            trunk_loss, mtp_loss = (sums / since).tolist()
            curve.append({"step": step, "elapsed_s": round(now, 1), "trunk_loss": trunk_loss, "mtp_loss": mtp_loss})
            log.info(
                "step %d  loss trunk %.4f mtp %.4f  lr %.2e  %.0f tok/s  %.1f s",
                *(step, trunk_loss, mtp_loss, optimizer.param_groups[0]["lr"]),
                *(since * tokens_per_step / max(now - last, 1e-9), now),
            )
            sums.zero_()
            since, last = 0, now
    return {"steps": step, "tokens_seen": step * tokens_per_step, "train_s": now, "curve": curve}


@torch.no_grad()
def evaluate(model: SmallFlashNext, tokens: torch.Tensor, seq: int, batch: int, device: torch.device) -> dict:
    """Mean loss and next-token accuracy of the trunk (t+1) and the teacher-forced MTP (t+2) over EVAL_WINDOWS
    evenly spaced windows, and how often the MTP's greedy token equals the trunk's greedy token at t+2."""
    starts = torch.linspace(0, tokens.numel() - (seq + 2), EVAL_WINDOWS).long().tolist()
    sums = dict.fromkeys(("trunk_loss", "trunk_accuracy", "mtp_loss", "mtp_accuracy", "mtp_agreement"), 0.0)
    model.eval()
    for i in range(0, len(starts), batch):
        window = windows(tokens, starts[i : i + batch], seq + 2).to(device)
        with autocast(device):
            trunk_logits, mtp_logits, _ = model(window)
        trunk_logits, mtp_logits = trunk_logits.float(), mtp_logits.float()
        for name, logits, target in (("trunk", trunk_logits, window[:, 1:-1]), ("mtp", mtp_logits, window[:, 2:])):
            sums[f"{name}_loss"] += F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum").item()
            sums[f"{name}_accuracy"] += (logits.argmax(-1) == target).sum().item()
        sums["mtp_agreement"] += (mtp_logits[:, :-1].argmax(-1) == trunk_logits[:, 1:].argmax(-1)).sum().item()
    model.train()
    rows = len(starts) * seq
    return {k: v / (len(starts) * (seq - 1) if k == "mtp_agreement" else rows) for k, v in sums.items()}


def write_tokenizer(src: Path, dst: Path, specials: dict[str, int]) -> None:
    """The data's tokenizer files and generation_config.json."""
    for name in TOKENIZER_FILES:
        shutil.copy2(src / name, dst / name)
    write_generation_config(dst, specials)


def save_bf16(model: SmallFlashNext, text: dict[str, Any], folder: Path) -> None:
    """config.json and model.safetensors: the trunk under transformers' text-only names, the MTP under `mtp.`."""
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model.trunk.save_pretrained(tmp)
        tensors: dict[str, torch.Tensor] = {}
        for file in Path(tmp).glob("*.safetensors"):
            with safe_open(file, "pt") as f:
                tensors |= {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    tensors |= {f"mtp.{name}": t for name, t in model.mtp.state_dict().items()}
    tensors = {n: (t.to(torch.bfloat16) if t.is_floating_point() else t).cpu() for n, t in tensors.items()}
    write_safetensors(tensors, folder, shards=1)
    config = {**text, "dtype": "bfloat16", "mtp_num_hidden_layers": 1, "architectures": ["Qwen4ExpForCausalLM"]}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def save_nvfp4(bf16: Path, folder: Path) -> dict[str, int]:
    """The released NVFP4 layout in the fewest safetensors files that keep every file within FILE_LIMIT bytes."""
    for shards in range(1, 9):
        if folder.exists():
            shutil.rmtree(folder)
        convert_checkpoint(bf16, folder, shards=shards)
        sizes = {path.name: path.stat().st_size for path in sorted(folder.iterdir())}
        if max(sizes.values()) <= FILE_LIMIT:
            return sizes
    raise ValueError(f"{folder}: a file stays over {FILE_LIMIT} bytes even in 8 shards")


def run(args: argparse.Namespace) -> tuple[SmallFlashNext, dict[str, Any]]:
    """Train, evaluate and save; the trained model and the report written to OUT/train_report.json."""
    begin = time.perf_counter()
    text = json.loads(args.config.read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    specials = check_data(args.data, text)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")
    torch.manual_seed(args.seed)
    model = SmallFlashNext(text).to(device)
    counts = parameter_counts(model)
    log.info("parameters: %s", counts)
    result = train(model, read_tokens(args.data / "train.bin"), args, device)
    evals = {
        split: evaluate(model, read_tokens(args.data / f"eval_{split}.bin"), args.seq, args.batch, device)
        for split in EVAL_SPLITS
    }
    for split, figures in evals.items():
        log.info("eval %s: %s", split, {k: round(v, 4) for k, v in figures.items()})
    bf16, nvfp4 = args.out / "bf16", args.out / "nvfp4"
    save_bf16(model, text, bf16)
    write_tokenizer(args.data / "tokenizer", bf16, specials)
    nvfp4_files = save_nvfp4(bf16, nvfp4)
    log.info("nvfp4: %d files, %d bytes", len(nvfp4_files), sum(nvfp4_files.values()))
    report = {
        "config": text,
        "settings": {k: v for k, v in vars(args).items() if k not in ("data", "config", "out")},
        "mtp_hidden": "not detached: the MTP loss trains the trunk too",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "parameters": counts,
        "steps": result["steps"],
        "tokens_seen": result["tokens_seen"],
        "train_s": round(result["train_s"], 1),
        "wall_s": round(time.perf_counter() - begin, 1),
        "eval": evals,
        "nvfp4_files": nvfp4_files,
        "loss_curve": result["curve"],
    }
    (args.out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return model, report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True, help="folder with the token bins, manifest and tokenizer")
    parser.add_argument("--config", type=Path, required=True, help="our text config JSON")
    parser.add_argument("--out", type=Path, required=True, help="folder for bf16/, nvfp4/ and train_report.json")
    parser.add_argument("--minutes", type=float, help="training time budget (the LR schedule fits into it)")
    parser.add_argument("--steps", type=int, help="at most this many steps")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    parser.add_argument("--seq", type=int, default=512, help="tokens per training window (default 512)")
    parser.add_argument("--batch", type=int, default=64, help="windows per step (default 64)")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default 2e-3)")
    parser.add_argument("--mtp-weight", type=float, default=0.3, help="weight of the MTP loss (default 0.3)")
    parser.add_argument("--seed", type=int, default=0, help="initialisation and window seed (default 0)")
    args = parser.parse_args(argv)
    if args.minutes is None and args.steps is None:
        parser.error("give --minutes, --steps or both")
    return args


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    _, report = run(parse_args(argv))
    log.info("report: %s", json.dumps({k: report[k] for k in ("steps", "tokens_seen", "train_s", "wall_s", "eval")}))


if __name__ == "__main__":
    main()
