"""scripts/eval_small.py: held-out figures through our forward, acceptance and speed through a live server."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from eval_small import chat_messages, documents, main, per_position_delta, score_window, windows
from transformers import AutoTokenizer

from model.flashnext import single_lane_batch
from model.weights import load_model
from tests.server.live import serve, tiny_chat_checkpoint

CODE = "def add(a, b):\n    return a + b\n\n\nclass Point:\n    x: int\n    y: int\n" * 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_chat_checkpoint(tmp_path_factory.mktemp("eval") / "m")


@pytest.fixture(scope="module")
def data(checkpoint, tmp_path_factory):
    """A corpus folder in the trainer's format, made with the checkpoint's tokenizer."""
    folder = tmp_path_factory.mktemp("data")
    shutil.copytree(checkpoint, folder / "tokenizer", ignore=shutil.ignore_patterns("*.safetensors*"))
    tokenizer = AutoTokenizer.from_pretrained(str(folder / "tokenizer"))
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    code = [*tokenizer.encode(CODE), eos]
    chats = []
    for name in ("add", "Point"):
        turns = [{"role": "user", "content": f"What does {name} do?"}, {"role": "assistant", "content": "It adds."}]
        chats += [*tokenizer.apply_chat_template(turns, tokenize=True, enable_thinking=False, return_dict=False), eos]
    np.asarray(code * 4, dtype="<u2").tofile(folder / "eval_code.bin")
    np.asarray(chats, dtype="<u2").tofile(folder / "eval_chat.bin")
    return folder


def test_documents_and_windows_cut_a_split_as_documented():
    tokens = np.array([5, 6, 0, 7, 0, 0, 8, 9, 10, 0])
    assert [d.tolist() for d in documents(tokens, 0)] == [[5, 6], [7], [8, 9, 10]]
    assert [w.tolist() for w in windows(tokens, 3, 4)] == [[5, 6, 0, 7], [7, 0, 0, 8], [8, 9, 10, 0]]
    with pytest.raises(ValueError, match="fewer than one window"):
        windows(tokens, 1, 11)


def test_chat_messages_drop_the_answer_and_the_empty_think_block():
    text = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\nFour.<|im_end|>\n"
    )
    assert chat_messages(text) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
    ]
    with pytest.raises(ValueError, match="no user turn"):
        chat_messages("<|im_start|>assistant\nHi<|im_end|>")


def test_score_window_counts_what_the_forward_predicts(checkpoint):
    model = load_model(checkpoint, dtype="float32")
    window = np.array([7, 19, 40, 33, 2, 91, 12, 44, 8, 13])
    figures = score_window(model, window)
    ids = torch.as_tensor(window)
    logits = model(single_lane_batch(model.new_lane(), ids, 0)).logits[:-1]
    assert figures["trunk_rows"] == 9 and figures["mtp_rows"] == 8
    assert figures["trunk_loss"] == pytest.approx(F.cross_entropy(logits, ids[1:], reduction="sum").item())
    assert figures["trunk_hits"] == (logits.argmax(-1) == ids[1:]).sum().item()
    assert 0 <= figures["mtp_agree"] <= 8 and figures["mtp_loss"] > 0


def test_per_position_delta_reads_prometheus_counters():
    before = 'flashnext:spec_decode_num_draft_tokens_per_pos_total{position="0"} 4.0\n'
    after = (
        'flashnext:spec_decode_num_draft_tokens_per_pos_total{position="0"} 10.0\n'
        'flashnext:spec_decode_num_draft_tokens_per_pos_total{position="1"} 2.0\n'
        'flashnext:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 3.0\n'
    )
    assert per_position_delta(before, after) == [
        {"position": 0, "drafted": 6.0, "accepted": 3.0, "acceptance": 0.5},
        {"position": 1, "drafted": 2.0, "accepted": 0.0, "acceptance": 0.0},
    ]


def test_offline_and_serve_reports(checkpoint, data, tmp_path):
    offline = tmp_path / "offline.json"
    main(["offline", "--data", str(data), "--model", str(checkpoint), "--windows", "2", "--seq", "24",
          "--json", str(offline)])  # fmt: skip
    report = json.loads(offline.read_text())
    for split in ("eval_code", "eval_chat"):
        assert 0 <= report[split]["trunk_accuracy"] <= 1 and report[split]["trunk_loss"] > 0
    online = tmp_path / "online.json"
    with serve(checkpoint, "--drafter", "mtp") as live:
        main(["serve", "--data", str(data), "--base-url", live.url, "--prompts", "2", "--prompt-tokens", "16",
              "--tokens", "6", "--streams", "1,2", "--json", str(online)])  # fmt: skip
    report = json.loads(online.read_text())
    for split in ("eval_code", "eval_chat"):
        assert report[split]["drafted_equals_undrafted"]
        assert report[split]["draft_tokens"] > 0 and report[split]["acceptance_per_position"][0]["drafted"] > 0
    assert [(s["streams"], s["draft"]) for s in report["speed"]] == [(1, False), (1, True), (2, False), (2, True)]
    assert all(s["tokens"] == 12 for s in report["speed"])
    assert all(s["equals_first_level"] for s in report["speed"])  # 2 concurrent streams = the same requests alone
