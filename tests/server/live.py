"""A live server on 127.0.0.1 inside the test process (uvicorn on a thread), and tiny checkpoints with tokenizers."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from make_checkpoint import hf_model, make_checkpoint

from server.app import build_app
from server.cli import build_parser
from server.frontend import listen_socket, uvicorn_config
from server.serve import create_serving
from tests.tiny import text_config


@dataclass(frozen=True, slots=True)
class Live:
    """A running server."""

    url: str
    model: str
    path: Path

    @property
    def v1(self) -> str:
        return f"{self.url}/v1"


def tiny_chat_checkpoint(path: Path, name: str = "base", seed: int = 0) -> Path:
    """A tiny fp32 checkpoint with a tokenizer and chat template."""
    return make_checkpoint(text_config(name), path, fmt="fp32", seed=seed, tokenizer=True)


def oracle_greedy(path: Path, prompt: list[int], tokens: int, **penalties) -> list[int]:
    """transformers' greedy tokens after the prompt, with vLLM's penalties: its own repetition penalty (over the
    prompt and the output), then frequency and presence penalties over the output, as vLLM takes them away; and
    vLLM's allowed_token_ids where given."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    from tests.tiny import ties_to_lower_index

    frequency, presence = penalties.get("frequency_penalty", 0.0), penalties.get("presence_penalty", 0.0)
    allowed = penalties.get("allowed_token_ids")

    class OutputPenalties(LogitsProcessor):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            output = input_ids[:, len(prompt) :]
            counts = torch.zeros_like(scores).scatter_add_(1, output, torch.ones_like(output, dtype=scores.dtype))
            scores = scores - frequency * counts
            scores = scores - presence * (counts > 0).to(scores.dtype)
            if allowed is not None:  # vLLM's allowed_token_ids: every other id is ruled out
                ruled_out = torch.ones_like(scores, dtype=torch.bool)
                ruled_out[:, allowed] = False
                scores = scores.masked_fill(ruled_out, -torch.inf)
            return scores

    with torch.no_grad(), ties_to_lower_index():
        out = oracle(path).generate(
            torch.tensor([prompt]), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
            repetition_penalty=penalties.get("repetition_penalty", 1.0),
            logits_processor=LogitsProcessorList([OutputPenalties()]),
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def oracle(path: Path, seed: int = 0):
    """transformers' model with the trunk of a checkpoint written by tiny_chat_checkpoint."""
    return hf_model(json.loads((path / "config.json").read_text()), seed)


@contextlib.contextmanager
def serve(path: Path, *flags: str) -> Iterator[Live]:
    """Serve a checkpoint until the block ends."""
    with contextlib.closing(listen_socket("127.0.0.1", 0)) as sock:  # bound now: no port picked, then bound later
        port = sock.getsockname()[1]
        args = build_parser().parse_args(["serve", str(path), "--host", "127.0.0.1", "--port", str(port), *flags])
        serving = create_serving(args)
        server = uvicorn.Server(uvicorn_config(build_app(serving.local_state()), serving.front))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        try:
            yield Live(f"{serving.front.http.scheme}://127.0.0.1:{port}", path.name, path)
        finally:
            server.should_exit = True
            thread.join(timeout=30)
