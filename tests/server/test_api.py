"""The OpenAI-compatible API through the official openai client, against a live server on 127.0.0.1."""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import MappingProxyType

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from tests.server.live import Live, oracle, oracle_greedy, serve, tiny_chat_checkpoint
from tests.tiny import ties_to_lower_index

PROMPT = [7, 19, 40, 33, 2, 91, 12, 44, 8, 13, 21, 60]
CHAT = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list, please."}]
COLOR = [{"role": "user", "content": "Name a color."}]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return tiny_chat_checkpoint(tmp_path_factory.mktemp("api") / "tiny-chat")


@pytest.fixture(scope="module")
def live(ckpt) -> Live:
    with serve(ckpt, "--max-lanes", "40") as running:
        yield running


def client(live: Live, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=live.v1, api_key=kwargs.pop("api_key", "unused"), max_retries=0, timeout=120, **kwargs
    )


def sha(ids: list[int]) -> str:
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()


def test_completions_with_token_ids_reproduce_transformers_greedy(live, ckpt):
    hf = oracle(ckpt)
    with torch.no_grad(), ties_to_lower_index():
        expected = hf.generate(torch.tensor([PROMPT]), max_new_tokens=20, min_new_tokens=20, do_sample=False)
    expected = expected[0, len(PROMPT) :].tolist()
    out = (
        client(live)
        .completions.create(
            model=live.model,
            prompt=PROMPT,
            max_tokens=20,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        .to_dict()
    )
    assert out["choices"][0]["token_ids"] == expected
    assert out["choices"][0]["prompt_token_ids"] == PROMPT
    assert out["token_sha"] == sha(expected)
    assert out["usage"]["prompt_tokens"] == len(PROMPT) and out["usage"]["completion_tokens"] == 20
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_logit_bias_is_added_to_the_logits_as_transformers_sequence_bias_adds_it(live, ckpt):
    """OpenAI's logit_bias: each given token's bias is added to its logit before the draw. Greedy output equals
    transformers' generate with the same biases as its sequence_bias, drafted or not; +100 makes a token certain."""
    hf = oracle(ckpt)
    with torch.no_grad(), ties_to_lower_index():
        plain = hf.generate(torch.tensor([PROMPT]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
        plain = plain[0, len(PROMPT) :].tolist()
        bias = {plain[0]: -100.0, plain[3]: -2.5, 77: 1.75}
        sequence_bias = {(token,): value for token, value in bias.items()}
        expected = hf.generate(
            torch.tensor([PROMPT]), max_new_tokens=12, min_new_tokens=12, do_sample=False, sequence_bias=sequence_bias
        )
    expected = expected[0, len(PROMPT) :].tolist()
    assert expected != plain

    def ids(temperature: float, logit_bias: dict[int, float], **extra) -> list[int]:
        out = client(live).completions.create(
            model=live.model,
            prompt=PROMPT,
            max_tokens=12,
            temperature=temperature,
            seed=3,
            logit_bias={str(token): value for token, value in logit_bias.items()},
            extra_body={"ignore_eos": True, "return_token_ids": True, **extra},
        )
        return out.to_dict()["choices"][0]["token_ids"]

    assert ids(0, bias) == ids(0, bias, draft=False) == expected
    assert ids(1.0, {plain[5]: 100.0}) == [plain[5]] * 12
    assert ids(0, {plain[0]: 0.0}) == plain  # a bias of 0 changes nothing


@pytest.mark.parametrize(
    "penalties",
    [{"repetition_penalty": 1.6}, {"frequency_penalty": 0.7, "presence_penalty": -0.4},
     {"repetition_penalty": 0.8, "frequency_penalty": -0.3, "presence_penalty": 1.5}],
    ids=["repetition", "output", "all"],
)  # fmt: skip
def test_penalties_equal_transformers_repetition_penalty_and_vllms_output_penalties(live, ckpt, penalties):
    """Greedy output with penalties equals transformers' generate with its repetition_penalty and the frequency and
    presence penalties taken away as vLLM does, drafted or not, streamed or not; and differs from output without."""
    expected = oracle_greedy(ckpt, PROMPT, 24, **penalties)
    assert expected != oracle_greedy(ckpt, PROMPT, 24)
    for extra in ({}, {"draft": False}, {"stream": True}):
        choice = completion(live, max_tokens=24, temperature=0, **penalties, **extra)
        assert choice["token_ids"] == expected, extra


def test_allowed_token_ids_restrict_the_draws_as_a_mask_on_transformers_logits(live, ckpt):
    """vLLM's allowed_token_ids: greedy output equals transformers' with every other id masked, drafted or not,
    streamed or not; sampled output holds only allowed ids."""
    plain = oracle_greedy(ckpt, PROMPT, 16)
    allowed = sorted({plain[1], plain[5], 30, 77, 150})
    expected = oracle_greedy(ckpt, PROMPT, 16, allowed_token_ids=allowed)
    assert expected != plain and set(expected) <= set(allowed)
    for extra in ({}, {"draft": False}, {"stream": True}):
        assert (
            completion(live, max_tokens=16, temperature=0, allowed_token_ids=allowed, **extra)["token_ids"] == expected
        )
    sampled = completion(live, max_tokens=16, temperature=1.0, seed=4, allowed_token_ids=allowed)["token_ids"]
    assert set(sampled) <= set(allowed) and len(sampled) == 16


@pytest.mark.parametrize(
    ("fields", "words"),
    [({"allowed_token_ids": [3, 400000]}, "outside the vocabulary"), ({"allowed_token_ids": []}, "at least 1"),
     ({"allowed_token_ids": [-1]}, "greater than or equal to 0"),
     ({"allowed_token_ids": [5], "stop_token_ids": [5], "min_tokens": 2}, "nothing is left to draw")],
)  # fmt: skip
def test_bad_allowed_token_ids_are_a_400_naming_the_field(live, fields, words):
    body = {"prompt": PROMPT, "max_tokens": 4, **fields}
    response = httpx.post(f"{live.v1}/completions", json=body, timeout=60)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"].startswith("allowed_token_ids") and words in error["message"]


def test_prompt_logprobs_are_transformers_log_softmax_of_each_prompt_tokens_row(live, ckpt):
    """vLLM's prompt_logprobs: None for the first token, then each prompt token's logprob given the tokens before it,
    its rank and the most likely ids', within float error of transformers' logits; a prompt longer than one pass's
    rows (128) gives the same as it would in one; a repeat resumes no kept state (it would have no logits)."""
    prompt = [(7 * i * i + 3 * i) % 300 + 5 for i in range(300)]
    with torch.no_grad(), ties_to_lower_index():
        logits = oracle(ckpt)(torch.tensor([prompt])).logits[0].float()
    expected = torch.log_softmax(logits, dim=-1)
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2}
    for _ in range(2):
        out = httpx.post(f"{live.v1}/completions", json=body, timeout=120).json()
        entries = out["choices"][0]["prompt_logprobs"]
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert len(entries) == len(prompt) and entries[0] is None
        for at, entry in enumerate(entries[1:], 1):
            row, token = expected[at - 1], prompt[at]
            likeliest = row.topk(2).indices.tolist()
            assert abs(entry[str(token)]["logprob"] - row[token].item()) < 1e-4, at
            assert entry[str(token)]["rank"] == int((row >= row[token]).sum()), at  # vLLM's: ids at least as likely
            assert set(map(int, entry)) == {token, *likeliest}, at
            assert [entry[str(top)]["rank"] for top in likeliest] == [1, 2], at
            assert all(isinstance(value["decoded_token"], str) for value in entry.values())
    chat = httpx.post(
        f"{live.v1}/chat/completions", json={"messages": COLOR, "max_tokens": 2, "prompt_logprobs": 0}, timeout=60
    ).json()
    assert chat["prompt_logprobs"][0] is None and all(len(entry) == 1 for entry in chat["prompt_logprobs"][1:])
    streamed = httpx.post(f"{live.v1}/completions", json={**body, "stream": True}, timeout=60)
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"


def test_echo_with_logprobs_gives_the_prompts_tokens_logprobs_first_as_openais_legacy_shape(live):
    """OpenAI's legacy echo with logprobs (what lm-eval's loglikelihood asks for): the prompt's tokens come first in
    `logprobs`, the first with null, the others with their prompt logprobs, then the completion's own; offsets run
    through the echoed text."""
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    plain = httpx.post(f"{live.v1}/completions", json={**body, "logprobs": 2}, timeout=60).json()["choices"][0]
    asked = httpx.post(f"{live.v1}/completions", json={**body, "prompt_logprobs": 2}, timeout=60).json()["choices"][0]
    echoed = httpx.post(f"{live.v1}/completions", json={**body, "logprobs": 2, "echo": True}, timeout=60).json()
    choice, prompt_entries = echoed["choices"][0], asked["prompt_logprobs"]
    logprobs = choice["logprobs"]
    assert (
        len(logprobs["tokens"]) == len(PROMPT) + 3 and logprobs["tokens"][len(PROMPT) :] == plain["logprobs"]["tokens"]
    )
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][1 : len(PROMPT)] == [
        entry[str(token)]["logprob"] for entry, token in zip(prompt_entries[1:], PROMPT[1:], strict=True)
    ]
    assert logprobs["token_logprobs"][len(PROMPT) :] == plain["logprobs"]["token_logprobs"]
    assert logprobs["top_logprobs"][len(PROMPT) :] == plain["logprobs"]["top_logprobs"]
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert offsets[len(PROMPT)] == sum(map(len, logprobs["tokens"][: len(PROMPT)]))  # on through the tokens' texts
    assert "prompt_logprobs" not in choice  # asked for as echo's logprobs, not as vLLM's field


@pytest.mark.parametrize("n", [1, 2])
def test_streamed_echo_with_logprobs_equals_the_non_streamed_one(live, n):
    """The echoed prompt waits for its logprobs and comes with each choice's first tokens, as vLLM streams it: the
    chunks' texts and logprobs joined are the non-streamed choice's, offsets included."""
    body = {"prompt": "def add(a, b):", "max_tokens": 5, "temperature": 0.7, "seed": 3, "ignore_eos": True,
            "logprobs": 2, "echo": True, "n": n}  # fmt: skip
    whole = httpx.post(f"{live.v1}/completions", json=body, timeout=60).json()["choices"]
    chunks = sse_chunks(live, "completions", body)
    for index in range(n):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        assert "".join(c["text"] for c in mine) == whole[index]["text"]
        pieces = [c["logprobs"] for c in mine if c["logprobs"]]
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert [v for p in pieces for v in p[key]] == whole[index]["logprobs"][key]


def test_echo_with_max_tokens_0_gives_the_prompt_alone_with_its_logprobs(live):
    """vLLM's echo of the prompt alone (max_tokens 0, what a loglikelihood of a whole text asks for): the prompt's
    text, its tokens' logprobs as echo gives them with an answer, no completion tokens; refused without echo or
    streamed."""
    body = {"prompt": "def add(a, b):", "temperature": 0, "echo": True, "logprobs": 2}
    with_answer = httpx.post(f"{live.v1}/completions", json={**body, "max_tokens": 2}, timeout=60).json()
    alone = httpx.post(f"{live.v1}/completions", json={**body, "max_tokens": 0, "n": 2}, timeout=60).json()
    prompt_tokens = alone["usage"]["prompt_tokens"]
    assert alone["usage"]["completion_tokens"] == 0 and alone["token_sha"] == sha([])
    for choice in alone["choices"]:
        assert choice["text"] == "def add(a, b):" and choice["finish_reason"] == "length"
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert choice["logprobs"][key] == with_answer["choices"][0]["logprobs"][key][:prompt_tokens]
    assert len(alone["choices"][0]["logprobs"]["tokens"]) == prompt_tokens
    text_only = httpx.post(f"{live.v1}/completions", json={"prompt": PROMPT, "echo": True, "max_tokens": 0}).json()
    assert text_only["choices"][0]["text"] and text_only["choices"][0]["logprobs"] is None
    for extra in ({"echo": False}, {"stream": True, "logprobs": None}):
        refused = httpx.post(f"{live.v1}/completions", json={**body, "max_tokens": 0, **extra})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


def test_logprobs_with_penalties_are_the_raw_logits_log_softmax(live):
    """As vLLM's default: the first token's logprobs, from the same raw logits, are the same with penalties or without
    (penalized logits would shift every one of them: the repetition penalty changes the prompt's ids' logits)."""
    plain = completion(live, max_tokens=1, temperature=0, logprobs=3)["logprobs"]
    penalized = completion(live, max_tokens=1, temperature=0, logprobs=3, repetition_penalty=1.6)["logprobs"]
    assert penalized["top_logprobs"] == plain["top_logprobs"] and plain["top_logprobs"][0]
    assert penalized["token_logprobs"] == plain["token_logprobs"]


def completion(live: Live, **fields) -> dict:
    """The one choice of a text completion of PROMPT with `fields`, streamed chunks' choices merged into one."""
    body = {"prompt": PROMPT, "ignore_eos": True, "return_token_ids": True, **fields}
    if not body.get("stream"):
        return httpx.post(f"{live.v1}/completions", json=body, timeout=60).json()["choices"][0]
    merged: dict = {"text": "", "token_ids": [], "logprobs": {}}
    for choice in completion_choices(live, True, **{k: v for k, v in body.items() if k != "stream"}):
        merged["text"] += choice["text"]
        merged["token_ids"] += choice.get("token_ids", [])
        for key, values in (choice["logprobs"] or {}).items():
            merged["logprobs"][key] = merged["logprobs"].get(key, []) + values
    return merged


def test_logprobs_are_each_tokens_raw_log_softmax_as_transformers_computes_it(live, ckpt):
    """A text completion's logprobs (OpenAI's legacy shape): each token's log-softmax of the model's raw logits, and
    the most likely tokens' (with the drawn one), within float error of transformers' own logits."""
    hf = oracle(ckpt)
    with torch.no_grad(), ties_to_lower_index():
        out = hf.generate(
            torch.tensor([PROMPT]), max_new_tokens=8, min_new_tokens=8, do_sample=False, output_logits=True,
            return_dict_in_generate=True,
        )  # fmt: skip
    expected = torch.log_softmax(torch.cat(out.logits).float(), dim=-1)
    choice = completion(live, max_tokens=8, temperature=0, logprobs=3)
    tokens, logprobs = choice["token_ids"], choice["logprobs"]
    assert tokens == out.sequences[0, len(PROMPT) :].tolist()
    got = torch.tensor(logprobs["token_logprobs"])
    assert torch.allclose(got, expected[torch.arange(8), tokens], atol=1e-4, rtol=0)
    for step, top in enumerate(logprobs["top_logprobs"]):
        assert max(top.values()) == logprobs["token_logprobs"][step]  # greedy: the drawn token is the likeliest
        likeliest = expected[step].topk(3).values  # keyed by text, tokens that spell alike share an entry
        assert all(torch.isclose(likeliest, torch.tensor(value), atol=1e-4, rtol=0).any() for value in top.values())
    offsets = [sum(map(len, logprobs["tokens"][:i])) for i in range(8)]
    assert logprobs["text_offset"] == offsets and "".join(logprobs["tokens"]) == choice["text"]


def test_logprobs_are_the_same_drafted_streamed_and_among_other_requests(live):
    """Exactness holds for logprobs as for tokens: drafted = undrafted = streamed, and concurrent = solo."""
    sampled = {"max_tokens": 10, "temperature": 0.8, "seed": 21, "logprobs": 2}
    alone = completion(live, **sampled)
    with ThreadPoolExecutor(5) as pool:
        others = [pool.submit(seeded, live, 300 + i, PROMPT[i:], 12) for i in range(4)]
        together = completion(live, **sampled)
        assert all(len(other.result()) == 64 for other in others)
    assert len(alone["logprobs"]["token_logprobs"]) == 10
    undrafted, streamed = completion(live, draft=False, **sampled), completion(live, stream=True, **sampled)
    shown = [(c["text"], c["token_ids"], c["logprobs"]) for c in (alone, together, undrafted, streamed)]
    assert shown == [shown[0]] * 4


def test_chat_logprobs_give_each_tokens_text_bytes_and_top_logprobs(live):
    """OpenAI's chat shape: logprobs.content has an entry per token with its text, logprob, UTF-8 bytes and the
    top_logprobs asked for, most likely first; streamed, each chunk has its own tokens' entries."""
    # a prompt of its own: the other chat tests count on CHAT's prompt not being cached before them
    body = {"max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 4}
    whole = chat_ids(live, COLOR, **body)["choices"][0]
    content = whole["logprobs"]["content"]
    assert len(content) == len(whole["token_ids"]) == 6
    for entry in content:  # a token that ends mid-character has the bytes it holds, its text a U+FFFD
        assert bytes(entry["bytes"]).decode(errors="replace") == entry["token"] and len(entry["top_logprobs"]) == 4
        tops = [top["logprob"] for top in entry["top_logprobs"]]
        assert tops == sorted(tops, reverse=True) and entry["logprob"] == tops[0]  # greedy
    chunks = list(
        client(live).chat.completions.create(
            model=live.model, messages=COLOR, stream=True, extra_body={"ignore_eos": True}, **body
        )
    )
    streamed = [entry.to_dict() for c in chunks for ch in c.choices if ch.logprobs for entry in ch.logprobs.content]
    assert streamed == content
    text = httpx.post(f"{live.url}/detokenize", json={"tokens": whole["token_ids"]}).json()["prompt"]
    assert b"".join(bytes(entry["bytes"]) for entry in content).decode(errors="replace") == text  # they spell it
    plain = chat_ids(live, COLOR, max_tokens=2, temperature=0)["choices"][0]
    assert plain["logprobs"] is None


def sse_chunks(live: Live, route: str, body: dict) -> list[dict]:
    """Every data chunk of a streamed request."""
    with httpx.stream("POST", f"{live.v1}/{route}", json={**body, "stream": True}, timeout=120) as response:
        return [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_n_choices_are_each_the_request_alone_with_its_seed_plus_the_choice_index(live, route):
    """OpenAI's n: choice i draws as the same request with n 1 and seed + i would, streamed or not; usage counts
    the prompt once and every choice's tokens; each choice carries its token_sha (the top level's is choice 0's)."""
    body = {"max_tokens": 10, "temperature": 1.0, "ignore_eos": True, "return_token_ids": True}
    body |= {"prompt": PROMPT} if route == "completions" else {"messages": COLOR}

    def alone(seed: int) -> list[int]:
        reply = httpx.post(f"{live.v1}/{route}", json={**body, "seed": seed}, timeout=120).json()
        return reply["choices"][0]["token_ids"]

    expected = [alone(seed) for seed in (2**63 - 2, 2**63 - 1, -(2**63))]  # seed + i wraps past the largest
    reply = httpx.post(f"{live.v1}/{route}", json={**body, "seed": 2**63 - 2, "n": 3}, timeout=120).json()
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2]
    assert [c["token_ids"] for c in reply["choices"]] == expected and len({tuple(e) for e in expected}) == 3
    assert [c["token_sha"] for c in reply["choices"]] == [sha(e) for e in expected]
    assert reply["token_sha"] == sha(expected[0]) and reply["usage"]["completion_tokens"] == 30
    prompt_tokens = reply["usage"]["prompt_tokens"]
    assert prompt_tokens == alone_usage(live, route, body)["prompt_tokens"]
    chunks = sse_chunks(live, route, {**body, "seed": 2**63 - 2, "n": 3, "stream_options": {"include_usage": True}})
    streamed = [[t for c in chunks for ch in c["choices"] if ch["index"] == i for t in ch.get("token_ids", [])]
                for i in range(3)]  # fmt: skip
    assert streamed == expected
    shas = {ch["index"]: c["token_sha"] for c in chunks if "token_sha" in c for ch in c["choices"]}
    assert shas == {i: sha(e) for i, e in enumerate(expected)}
    assert chunks[-1]["usage"]["completion_tokens"] == 30 and chunks[-1]["usage"]["prompt_tokens"] == prompt_tokens
    assert len(prompt_ids_sent(route, chunks)) == 3  # as vLLM: in each choice's first chunk


@pytest.mark.parametrize("streamed", [False, True])
def test_a_batch_of_prompts_gives_each_prompts_n_choices_in_order_each_as_alone(live, streamed):
    """OpenAI's batch of prompts: choice i * n + j is prompt i's choice j, the same tokens as prompt i sent alone
    with n and the seed; each carries its prompt's ids and echo; usage counts each prompt once."""
    prompts = [PROMPT, PROMPT[:5], [3, 1, 4, 1, 5, 9, 2, 6]]
    body = {"max_tokens": 6, "temperature": 1.0, "seed": 11, "n": 2, "ignore_eos": True, "return_token_ids": True}

    def alone(prompt: list[int]) -> list[dict]:
        return httpx.post(f"{live.v1}/completions", json={**body, "prompt": prompt}, timeout=120).json()["choices"]

    expected = [choice for prompt in prompts for choice in alone(prompt)]
    batch = {**body, "prompt": prompts, "echo": True}
    if streamed:
        chunks = sse_chunks(live, "completions", {**batch, "stream_options": {"include_usage": True}})
        choices = [{"token_ids": [t for c in chunks for ch in c["choices"] if ch["index"] == i
                                  for t in ch.get("token_ids", [])],
                    "prompt_token_ids": next(ch["prompt_token_ids"] for c in chunks for ch in c["choices"]
                                             if ch["index"] == i and "prompt_token_ids" in ch),
                    "text": "".join(ch["text"] for c in chunks for ch in c["choices"] if ch["index"] == i)}
                   for i in range(6)]  # fmt: skip
        usage = chunks[-1]["usage"]
    else:
        reply = httpx.post(f"{live.v1}/completions", json=batch, timeout=120).json()
        assert [c["index"] for c in reply["choices"]] == list(range(6))
        choices, usage = reply["choices"], reply["usage"]
    assert [c["token_ids"] for c in choices] == [c["token_ids"] for c in expected]
    assert [c["prompt_token_ids"] for c in choices] == [p for p in prompts for _ in range(2)]
    for choice, plain, prompt in zip(choices, expected, [p for p in prompts for _ in range(2)], strict=True):
        echoed = httpx.post(f"{live.url}/detokenize", json={"tokens": prompt}).json()["prompt"]
        assert choice["text"] == echoed + plain["text"]
    assert usage["prompt_tokens"] == sum(map(len, prompts)) and usage["completion_tokens"] == 36


@pytest.mark.parametrize(
    ("prompt", "param"), [([PROMPT, [5, 10**9]], "prompt.1"), (["ok", ""], "prompt"), ([[1], []], "prompt")]
)
def test_a_batch_with_one_bad_prompt_is_a_400_naming_it_and_runs_nothing(live, prompt, param):
    before = httpx.get(f"{live.url}/metrics").text.count("\n")
    response = httpx.post(f"{live.v1}/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=60)
    assert response.status_code == 400 and error_of(response)["param"] == param
    assert before == httpx.get(f"{live.url}/metrics").text.count("\n")


def alone_usage(live: Live, route: str, body: dict) -> dict:
    return httpx.post(f"{live.v1}/{route}", json={**body, "max_tokens": 1}, timeout=120).json()["usage"]


def test_min_tokens_keeps_stop_tokens_out_as_transformers_min_new_tokens_does(live, ckpt):
    """vLLM's min_tokens: a stop token cannot be drawn before that many tokens (its logit is -inf), and ends the
    output after: greedy output equals transformers' generate with min_new_tokens and that token as its EOS,
    drafted or not."""
    hf = oracle(ckpt)
    with torch.no_grad(), ties_to_lower_index():
        plain = hf.generate(torch.tensor([PROMPT]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
        stop = plain[0, len(PROMPT) + 1].item()  # the second token: one min_tokens has to keep out
        expected = hf.generate(
            torch.tensor([PROMPT]), max_new_tokens=12, min_new_tokens=6, do_sample=False, eos_token_id=[stop]
        )[0, len(PROMPT) :].tolist()
    assert stop not in expected[:6] and expected != plain[0, len(PROMPT) :].tolist()
    body = {"temperature": 0, "max_tokens": 12, "stop_token_ids": [stop], "min_tokens": 6}
    drafted, undrafted = (completion(live, **body, **extra) for extra in ({}, {"draft": False}))
    assert drafted["token_ids"] == undrafted["token_ids"] == expected
    assert drafted["finish_reason"] == ("stop" if expected[-1] == stop else "length")


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"stop_token_ids": [7, 1000000], "min_tokens": 2}, "stop_token_ids", "token id 1000000 is outside"),
        ({"stop_token_ids": [1000000]}, "stop_token_ids", "token id 1000000 is outside"),
        ({"min_tokens": 17}, "min_tokens", "more than the 16 tokens"),  # a text completion's default max_tokens
    ],
)
def test_stop_tokens_outside_the_vocabulary_and_min_tokens_past_the_limit_are_400s(live, fields, param, words):
    """Refused before they reach a round, where a suppressed id outside the logits failed every request in it."""
    with ThreadPoolExecutor(1) as pool:
        long = pool.submit(seeded, live, 99, PROMPT, 48)
        response = httpx.post(f"{live.v1}/completions", json={"prompt": PROMPT, **fields})
        assert response.status_code == 400 and error_of(response)["param"] == param
        assert words in error_of(response)["message"] and len(long.result()) == 64


@pytest.mark.parametrize("bias", [5, 0])
def test_a_logit_bias_outside_the_vocabulary_is_a_400_naming_it(live, bias):
    """As vLLM checks every key: a bias of 0, which changes nothing, still names a token id."""
    body = {"prompt": PROMPT, "max_tokens": 2, "logit_bias": {"7": 1, "1000000": bias}}
    response = httpx.post(f"{live.v1}/completions", json=body)
    assert response.status_code == 400 and error_of(response)["param"] == "logit_bias"
    assert "token id 1000000 is outside the vocabulary" in error_of(response)["message"]


def chat_ids(live: Live, messages, **extra) -> dict:
    """A greedy 12-token chat completion with the extension fields in `extra`."""
    return (
        client(live)
        .chat.completions.create(
            model=live.model,
            messages=messages,
            max_tokens=12,
            temperature=0,
            extra_body={"return_token_ids": True, "ignore_eos": True, **extra},
        )
        .to_dict()
    )


def test_chat_usage_finish_reason_and_stop_token(live):
    prompt_tokens = httpx.post(f"{live.url}/tokenize", json={"messages": CHAT}).json()["count"]
    out = chat_ids(live, CHAT)
    tokens = out["choices"][0]["token_ids"]
    assert out["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 12,
        "total_tokens": prompt_tokens + 12,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert out["choices"][0]["finish_reason"] == "length"
    stopped = chat_ids(live, CHAT, stop_token_ids=[tokens[3]])
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["choices"][0]["token_ids"] == tokens[: tokens.index(tokens[3]) + 1]
    assert stopped["usage"]["completion_tokens"] == tokens.index(tokens[3]) + 1
    assert (out["choices"][0]["stop_reason"], stopped["choices"][0]["stop_reason"]) == (None, tokens[3])
    body = {"messages": CHAT, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{live.v1}/chat/completions", json={**body, "stop_token_ids": [tokens[3]]}) as reply:
        chunks = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {")]
    reasons = [choice["stop_reason"] for chunk in chunks for choice in chunk["choices"]]
    assert reasons == [None] * (len(reasons) - 1) + [tokens[3]]  # streamed: in the last chunk only


def completion_choices(live: Live, streamed: bool, **extra) -> list[dict]:
    """A greedy 12-token text completion of PROMPT with `extra`: its one choice, or every streamed chunk's choice."""
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stream": streamed, **extra}
    with httpx.stream("POST", f"{live.v1}/completions", json=body, timeout=60) as response:
        text = response.read().decode()
    if not streamed:
        return json.loads(text)["choices"]
    return [
        choice for line in text.splitlines() if line.startswith("data: {") for choice in json.loads(line[6:])["choices"]
    ]


@pytest.mark.parametrize("streamed", [False, True])
def test_stop_reason_names_the_stop_string_or_stop_token_that_ended_the_output(live, streamed):
    """As vLLM's: a choice's stop_reason is the stop string or the stop_token_ids id that ended it, and null when
    the output ended at its length (streamed, null in every chunk before the last)."""
    whole = completion_choices(live, False, ignore_eos=True, return_token_ids=True)[0]
    tokens, text = whole["token_ids"], whole["text"]
    stop = text[len(text) // 2 :][:2]
    assert stop and whole["finish_reason"] == "length" and whole["stop_reason"] is None
    cases = [({"stop_token_ids": [tokens[4]]}, tokens[4]), ({"stop": ["\x00never", stop]}, stop), ({}, None)]
    for extra, reason in cases:
        choices = completion_choices(live, streamed, ignore_eos=True, **extra)
        assert [c["stop_reason"] for c in choices] == [None] * (len(choices) - 1) + [reason]
        assert choices[-1]["finish_reason"] == ("length" if reason is None else "stop")


def test_thinking_goes_to_reasoning_content(live):
    thinking = chat_ids(live, CHAT)
    plain = chat_ids(live, CHAT, chat_template_kwargs={"enable_thinking": False})
    text = httpx.post(f"{live.url}/detokenize", json={"tokens": thinking["choices"][0]["token_ids"]}).json()["prompt"]
    message = thinking["choices"][0]["message"]
    # random weights never close the think block: everything is reasoning, as a thinking model's unfinished draft
    assert "</think>" not in text
    assert message["reasoning_content"] == message["reasoning"] and message["content"] == ""
    assert message["reasoning_content"] and message["reasoning_content"].strip() in text
    assert plain["choices"][0]["message"]["reasoning_content"] is None
    assert plain["choices"][0]["message"]["content"]


def test_openais_reasoning_effort_shapes_the_prompt_as_tokenize_shows_it(live):
    plain = httpx.post(f"{live.url}/tokenize", json={"messages": CHAT}).json()["count"]
    effort = httpx.post(f"{live.url}/tokenize", json={"messages": CHAT, "reasoning_effort": "high"}).json()["count"]
    out = chat_ids(live, CHAT, reasoning_effort="high")
    assert out["usage"]["prompt_tokens"] == effort != plain


def test_streaming_equals_non_streaming(live):
    chat_ids(live, CHAT)  # the prompt cache keeps the prompt from here: both calls below report the same cached tokens
    whole = chat_ids(live, CHAT)
    chunks = list(
        client(live).chat.completions.create(
            model=live.model,
            messages=CHAT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
    )
    chunks = [c.to_dict() for c in chunks]
    ids = [t for c in chunks for choice in c["choices"] for t in choice.get("token_ids", [])]
    reasoning = "".join(ch["delta"].get("reasoning_content") or "" for c in chunks for ch in c["choices"])
    assert ids == whole["choices"][0]["token_ids"]
    assert reasoning == whole["choices"][0]["message"]["reasoning_content"]
    assert [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]] == ["length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    assert chunks[-1]["token_sha"] == whole["token_sha"]


def seeded(live: Live, seed: int, prompt: list[int] = PROMPT, tokens: int = 16) -> str:
    out = (
        client(live)
        .completions.create(
            model=live.model,
            prompt=prompt,
            max_tokens=tokens,
            temperature=1.0,
            seed=seed,
            extra_body={"ignore_eos": True},
        )
        .to_dict()
    )
    assert out["usage"]["completion_tokens"] == tokens
    return out["token_sha"]


def test_a_seeded_request_is_the_same_alone_and_among_eight(live):
    alone = seeded(live, 1234)
    others = [(1234 + i, [5 + i, *PROMPT[i:]]) for i in range(1, 8)]
    barrier = threading.Barrier(8)

    def run(seed_prompt):
        barrier.wait()
        return seeded(live, *seed_prompt)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, [(1234, PROMPT), *others]))
    assert results[0] == alone
    assert seeded(live, 4321) != alone


def error_of(response: httpx.Response) -> dict:
    return response.json()["error"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": 0}, "top_p"),
        ({"temperature": "hot"}, "temperature"),
        ({"messages": [{"content": "no role"}]}, "messages.0.role"),
        ({"messages": []}, "messages"),
        ({"n": 129}, "n"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"model": "gpt-4"}, "model"),
    ],
)
def test_bad_chat_fields_get_400s_naming_them(live, body, param):
    request = {"model": live.model, "messages": CHAT, "max_tokens": 4, **body}
    response = httpx.post(f"{live.v1}/chat/completions", json=request)
    assert response.status_code == (404 if param == "model" else 400)
    error = error_of(response)
    assert error["param"] == param and param.split(".")[0] in error["message"]


def test_stop_strings_are_refused_by_a_model_without_a_tokenizer():
    """Without a tokenizer no text is made, so a stop string could never match: a 400 naming it, and nothing runs."""
    from fastapi.testclient import TestClient

    from server.app import ServerState, build_app
    from server.engine import Update
    from tests.server.test_generation import RecordingEngine

    class Finishing(RecordingEngine):
        def submit(self, request) -> None:
            super().submit(request)
            request.sink(Update((), "length"))

    engine = Finishing()
    http = TestClient(build_app(ServerState(engine, None, "m", 256, 512, (0,))))
    response = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "stop": ["x"]})
    assert response.status_code == 400 and error_of(response)["param"] == "stop"
    assert "tokenizer" in error_of(response)["message"] and engine.submitted == []


def test_a_messages_name_reaches_the_chat_template():
    """A chat message's `name` is given to the template with its role and content (the template decides its use)."""
    from fastapi.testclient import TestClient

    from server.app import ServerState, build_app
    from tests.server.test_generation import RecordingEngine

    class Template:
        """A tokenizer that records the messages its chat template gets."""

        def __init__(self) -> None:
            self.messages: list[dict] = []

        def apply_chat_template(self, messages, **kwargs) -> str:
            self.messages = messages
            return "rendered"

        def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
            return {"input_ids": [5, 6]}

    tokenizer = Template()
    http = TestClient(build_app(ServerState(RecordingEngine(), tokenizer, "m", 256, 512, (0,))))
    chat = [{"role": "user", "content": "hi", "name": "ann"}, {"role": "user", "content": "yo"}]
    assert http.post("/tokenize", json={"messages": chat}).json()["tokens"] == [5, 6]
    assert tokenizer.messages == [{"role": "user", "content": "hi", "name": "ann"}, {"role": "user", "content": "yo"}]


@pytest.mark.parametrize(
    ("extra", "param"), [({}, "messages"), ({"chat_template_kwargs": {"style": "loud"}}, "chat_template_kwargs")]
)
def test_a_template_refusal_names_what_caused_it(extra, param):
    """The template refuses the messages themselves whatever the switches (no user turn here): the 400 names
    messages; when only the switches make it refuse, it names chat_template_kwargs."""
    from fastapi.testclient import TestClient

    from server.app import ServerState, build_app
    from tests.server.test_generation import RecordingEngine

    class Strict:
        """A tokenizer whose template wants a user turn and knows no style."""

        def apply_chat_template(self, messages, style: str | None = None, **kwargs) -> str:
            if style is not None:
                raise ValueError(f"unknown style {style}")
            if not any(m["role"] == "user" for m in messages):
                raise ValueError("no user query found")
            return "rendered"

        def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
            return {"input_ids": [5, 6]}

    http = TestClient(build_app(ServerState(RecordingEngine(), Strict(), "m", 256, 512, (0,))))
    role = "user" if extra else "system"
    response = http.post("/tokenize", json={"messages": [{"role": role, "content": "hi"}], **extra})
    assert response.status_code == 400 and error_of(response)["param"] == param


class CountingTokenizer:
    """A tokenizer whose chat template gives each message one token and counts its renders."""

    def __init__(self) -> None:
        self.renders = 0

    def apply_chat_template(self, messages, **kwargs) -> str:
        self.renders += 1
        return "x" * len(messages)

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [5] * len(text)}

    # what a response's detokenizer asks of a tokenizer with no special tokens
    added_tokens_decoder = MappingProxyType({})
    all_special_ids = ()

    def convert_tokens_to_ids(self, token: str) -> None:
        return None

    def decode(self, ids: list[int], **kwargs) -> str:
        return "x" * len(ids)


def test_a_chat_beyond_the_context_is_refused_before_each_message_end_is_rendered():
    """Finding where each message ends renders every prefix of the messages, work that grows with their square (a
    hundred thousand messages held the event loop for hours): a prompt beyond the context is refused first."""
    from fastapi.testclient import TestClient

    from server.app import ServerState, build_app
    from tests.server.test_generation import RecordingEngine

    class Caching(RecordingEngine):
        cache_enabled = True

    tokenizer = CountingTokenizer()
    http = TestClient(build_app(ServerState(Caching(), tokenizer, "m", 256, 512, (0,))))
    response = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}] * 300})
    assert response.status_code == 400 and error_of(response)["code"] == "context_length_exceeded"
    assert tokenizer.renders == 1


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/v1/chat/completions", {"messages": CHAT}),
        ("/v1/completions", {"prompt": "def add(a, b):"}),
        ("/tokenize", {"prompt": "def add(a, b):"}),
    ],
)
def test_prompts_are_tokenized_while_the_event_loop_answers_others(ckpt, route, body):
    """Rendering and tokenizing a prompt take time that grows with it (a chat's with the square of its messages, for
    the prompt cache's boundaries): they run on a worker thread, so the loop that streams every other response
    answers /health meanwhile."""
    from fastapi.testclient import TestClient
    from transformers import AutoTokenizer

    from server.app import ServerState, build_app
    from server.engine import Update
    from tests.server.test_generation import RecordingEngine

    class Held:
        """The checkpoint's tokenizer, whose first encoding waits (30 s at most) until /health has been answered."""

        def __init__(self, tokenizer) -> None:
            self.tokenizer, self.encoding, self.answered = tokenizer, threading.Event(), threading.Event()
            self.waited: bool | None = None

        def __getattr__(self, name: str):
            return getattr(self.tokenizer, name)

        def __call__(self, text: str, **kwargs) -> dict:
            if self.waited is None:
                self.encoding.set()
                self.waited = self.answered.wait(30)
            return self.tokenizer(text, **kwargs)

    tokenizer = Held(AutoTokenizer.from_pretrained(ckpt))

    class Answering(RecordingEngine):
        """An engine that finishes each request at once and answers /health."""

        async def attach(self, loop) -> None:
            pass

        def detach(self) -> None:
            pass

        def submit(self, request) -> None:
            super().submit(request)
            request.sink(Update((), "length"))

        async def stats(self) -> dict:
            tokenizer.answered.set()
            return {}

    app = build_app(ServerState(Answering(), tokenizer, "m", 256, len(tokenizer.tokenizer), (0,)))
    with TestClient(app) as http, ThreadPoolExecutor(1) as pool:
        asked = pool.submit(http.post, route, json={**body, "max_tokens": 1})
        assert tokenizer.encoding.wait(30)
        assert http.get("/health").status_code == 200
        assert asked.result().status_code == 200
    assert tokenizer.waited is True


def test_context_overflow_is_refused_with_its_code(live):
    response = httpx.post(f"{live.v1}/completions", json={"prompt": PROMPT, "max_tokens": 100_000})
    assert response.status_code == 400 and error_of(response)["code"] == "context_length_exceeded"
    response = httpx.post(f"{live.v1}/completions", json={"prompt": [7] * 5000, "max_tokens": 1})
    assert response.status_code == 400 and error_of(response)["code"] == "context_length_exceeded"
    response = httpx.post(f"{live.v1}/completions", json={"prompt": [7, 99999]})
    assert response.status_code == 400 and error_of(response)["param"] == "prompt"
    response = httpx.post(f"{live.v1}/completions", json={"prompt": PROMPT, "max_completion_tokens": 100_000})
    error = error_of(response)
    assert (error["code"], error["param"]) == ("context_length_exceeded", "max_completion_tokens")
    assert "max_completion_tokens asks for 100000" in error["message"]  # the field the client sent, not max_tokens


def test_bad_requests_lose_nothing_in_flight(live):
    with ThreadPoolExecutor(1) as pool:
        long = pool.submit(seeded, live, 99, PROMPT, 48)
        for _ in range(10):
            assert httpx.post(f"{live.v1}/chat/completions", json={"messages": "x"}).status_code == 400
        assert len(long.result()) == 64


def test_a_temperature_below_vllms_floor_draws_as_the_floor(live):
    """vLLM raises a temperature between 0 and 0.01 to 0.01 (1e-40 overflowed the logits, a 400): the same tokens as
    0.01 with the same seed, for n 2 and streamed too."""
    body = {"prompt": PROMPT, "max_tokens": 6, "seed": 5, "n": 2, "ignore_eos": True, "return_token_ids": True}

    def tokens(temperature: float, stream: bool) -> list[list[int]]:
        asked = {**body, "temperature": temperature}
        if stream:
            chunks = sse_chunks(live, "completions", asked)
            by_choice: dict[int, list[int]] = {}
            for chunk in chunks:
                for choice in chunk["choices"]:
                    by_choice.setdefault(choice["index"], []).extend(choice.get("token_ids") or [])
            return [by_choice[i] for i in sorted(by_choice)]
        response = httpx.post(f"{live.v1}/completions", json=asked, timeout=60)
        assert response.status_code == 200, response.text
        return [choice["token_ids"] for choice in response.json()["choices"]]

    floor = tokens(0.01, False)
    assert all(len(choice) == 6 for choice in floor)
    assert tokens(1e-40, False) == floor and tokens(1e-40, True) == floor


@pytest.mark.parametrize("include_usage", [False, True])
def test_with_include_usage_every_chunk_but_the_last_has_null_usage(live, include_usage):
    """OpenAI's stream shape: with include_usage every chunk carries "usage" (null until the last, usage-only one);
    without it no chunk has the key."""
    body = {"prompt": PROMPT, "max_tokens": 3, "ignore_eos": True, "stream": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", f"{live.v1}/completions", json=body, timeout=60) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    if include_usage:
        assert all("usage" in c and c["usage"] is None for c in chunks[:-1])
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    else:
        assert not any("usage" in c for c in chunks)


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_continuous_usage_stats_give_every_chunk_its_choices_usage_so_far(live, route):
    """vLLM's continuous_usage_stats (with include_usage): every chunk carries the prompt's tokens and its own choice's
    tokens so far; the last, usage-only chunk counts every choice; with include_usage false there is no usage at all."""
    body = {"max_tokens": 6, "ignore_eos": True, "return_token_ids": True, "n": 2, "temperature": 1.0, "seed": 3}
    body |= {"prompt": PROMPT} if route == "completions" else {"messages": COLOR}
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = sse_chunks(live, route, {**body, "stream_options": options})
    prompt = chunks[-1]["usage"]["prompt_tokens"]
    counted = {0: 0, 1: 0}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        counted[choice["index"]] += len(choice.get("token_ids", []))
        expected = {"prompt_tokens": prompt, "completion_tokens": counted[choice["index"]]}
        assert (
            chunk["usage"]["prompt_tokens"] == prompt
            and chunk["usage"]["completion_tokens"] == counted[choice["index"]]
        )
        assert chunk["usage"] == {**expected, "total_tokens": sum(expected.values())}  # no cached count: vLLM's shape
    assert counted == {0: 6, 1: 6} and chunks[-1]["usage"]["completion_tokens"] == 12 and chunks[-1]["choices"] == []
    off = sse_chunks(live, route, {**body, "stream_options": {"include_usage": False, "continuous_usage_stats": True}})
    assert not any("usage" in c for c in off)


def test_echo_puts_the_prompts_text_before_each_choices_streamed_or_not(live):
    """vLLM's echo for text completions: the text prompt itself, or a prompt of ids decoded, before the completion's
    text; streamed, in each choice's first chunk; the tokens, ids and usage stay the completion's own."""
    text = "def add(a, b):"
    body = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True, "n": 2}
    plain = httpx.post(f"{live.v1}/completions", json={**body, "prompt": text}, timeout=60).json()
    echoed = httpx.post(f"{live.v1}/completions", json={**body, "prompt": text, "echo": True}, timeout=60).json()
    assert [c["text"] for c in echoed["choices"]] == [text + c["text"] for c in plain["choices"]]
    assert [c["token_ids"] for c in echoed["choices"]] == [c["token_ids"] for c in plain["choices"]]
    assert echoed["usage"]["total_tokens"] == plain["usage"]["total_tokens"]
    assert echoed["token_sha"] == plain["token_sha"]
    chunks = sse_chunks(live, "completions", {**body, "prompt": text, "echo": True})
    streamed = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk["choices"]:
            streamed[choice["index"]] += choice["text"]
    assert list(streamed.values()) == [c["text"] for c in echoed["choices"]]
    ids = plain["choices"][0]["prompt_token_ids"]
    by_ids = httpx.post(f"{live.v1}/completions", json={**body, "prompt": ids, "echo": True}, timeout=60).json()
    assert by_ids["choices"][0]["text"] == echoed["choices"][0]["text"]


def prompt_ids_sent(route: str, responses: list[dict]) -> list[list[int]]:
    """Every `prompt_token_ids` in the responses, looked for only where vLLM puts it: a chat response's (or chunk's)
    top level, a text completion's choice."""
    if route == "chat/completions":
        return [r["prompt_token_ids"] for r in responses if "prompt_token_ids" in r]
    return [choice["prompt_token_ids"] for r in responses for choice in r["choices"] if "prompt_token_ids" in choice]


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
@pytest.mark.parametrize("streamed", [False, True])
def test_return_token_ids_sends_the_prompts_ids_once_where_vllm_does(live, route, streamed):
    """Streamed, the prompt's ids come once, in the first chunk (as vLLM's), where the non-streamed response has
    them; a chat response has them at the top level, not in its choice (vLLM's chat response), and a text completion
    in its choice."""
    body = {"max_tokens": 3, "ignore_eos": True, "stream": streamed, "return_token_ids": True}
    body |= {"prompt": PROMPT} if route == "completions" else {"messages": CHAT}
    prompt = PROMPT if route == "completions" else httpx.post(f"{live.url}/tokenize", json=body).json()["tokens"]
    with httpx.stream("POST", f"{live.v1}/{route}", json=body, timeout=60) as response:
        text = response.read().decode()
    responses = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")] or [json.loads(text)]
    assert prompt_ids_sent(route, responses) == prompt_ids_sent(route, responses[:1]) == [prompt]
    if route == "chat/completions":
        assert not any("prompt_token_ids" in choice for r in responses for choice in r["choices"])
    assert len([t for r in responses for choice in r["choices"] for t in choice.get("token_ids", [])]) == 3


def test_thirty_two_streams_all_complete(live):
    def stream(i: int) -> int:
        chunks = client(live).chat.completions.create(
            model=live.model,
            messages=[{"role": "user", "content": f"count to {i}"}],
            max_tokens=10,
            temperature=0.8,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        return [c for c in chunks][-1].usage.completion_tokens

    # one stream first: the openai client builds its chunk models' pydantic schemas on first use, and 32 threads
    # building them at once can meet a half-built one (PydanticUserError in the client, seen once in CI)
    assert stream(32) == 10
    with ThreadPoolExecutor(32) as pool:
        assert list(pool.map(stream, range(32))) == [10] * 32


def test_models_metrics_tokenize_detokenize(live):
    assert [m.id for m in client(live).models.list()] == [live.model]
    assert client(live).models.retrieve(live.model).id == live.model
    with pytest.raises(openai.NotFoundError):
        client(live).models.retrieve("org/another-model")
    ids = httpx.post(f"{live.url}/tokenize", json={"prompt": "def add(a, b):"}).json()["tokens"]
    assert httpx.post(f"{live.url}/detokenize", json={"tokens": ids}).json()["prompt"] == "def add(a, b):"
    refused = httpx.post(f"{live.url}/detokenize", json={"tokens": [True]})  # a JSON bool is not a token id
    assert refused.status_code == 400 and error_of(refused)["param"] == "tokens"
    other = httpx.post(f"{live.url}/tokenize", json={"prompt": "x", "model": "another-model"})
    assert other.status_code == 404 and error_of(other)["param"] == "model"
    opened = httpx.post(f"{live.url}/tokenize", json={"messages": CHAT}).json()["tokens"]
    unopened = httpx.post(f"{live.url}/tokenize", json={"messages": CHAT, "add_generation_prompt": False}).json()
    assert unopened["tokens"] == opened[: len(unopened["tokens"])] and len(unopened["tokens"]) < len(opened)
    bad_switch = httpx.post(f"{live.url}/tokenize", json={"messages": CHAT, "continue_final_message": True})
    assert bad_switch.status_code == 400 and error_of(bad_switch)["param"] == "continue_final_message"
    stringly = httpx.post(f"{live.url}/tokenize", json={"prompt": "x", "add_special_tokens": "false"})
    assert stringly.status_code == 400 and error_of(stringly)["param"] == "add_special_tokens"
    metrics = httpx.get(f"{live.url}/metrics").text
    for name in (
        "flashnext:num_requests_running",
        "flashnext:num_requests_waiting",
        "flashnext:prompt_tokens_total",
        "flashnext:generation_tokens_total",
        "flashnext:time_to_first_token_seconds_bucket",
        "flashnext:inter_token_latency_seconds_bucket",
        f'flashnext:collectives_total{{model_name="{live.model}",op="combine"}} 0.0',  # tp 1 makes no collectives
        f'flashnext:collective_bytes_total{{model_name="{live.model}",op="gather"}} 0.0',
    ):
        assert name in metrics
    assert httpx.get(f"{live.url}/health").json()["status"] == "ok"


def test_a_client_that_disconnects_frees_its_lane(ckpt):
    with serve(ckpt, "--max-lanes", "1") as one_lane:
        body = {"prompt": PROMPT, "max_tokens": 3000, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{one_lane.v1}/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert [next(lines) for _ in range(4)]
        # the only lane was held by a 3000-token request; the next request gets it once the client has gone
        assert len(seeded(one_lane, 5, PROMPT, 4)) == 64
        assert httpx.get(f"{one_lane.url}/health").json()["requests_running"] == 0


@pytest.mark.parametrize(("key", "n"), [(None, 1), ("sesame", 1), (None, 3)])
def test_a_non_streamed_request_whose_client_disconnects_frees_its_lane(ckpt, key, n):
    """The route sees the client leave (with or without the API key's middleware) and the engine drops the request
    (each of its n choices, those still waiting for a lane too) instead of drawing all its tokens."""
    flags = ("--max-lanes", "1") + (("--api-key", key) if key else ())
    with serve(ckpt, *flags) as one_lane:
        body = json.dumps({"prompt": PROMPT, "max_tokens": 3000, "ignore_eos": True, "n": n}).encode()
        auth = f"Authorization: Bearer {key}\r\n".encode() if key else b""
        host, port = one_lane.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + auth
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            running = wait_for_running(one_lane, lambda n: n == 1)
            assert running == 1
        assert wait_for_running(one_lane, lambda n: n == 0) == 0  # within seconds, long before 3000 tokens
        metrics = httpx.get(f"{one_lane.url}/metrics").text
        ended = f'flashnext:request_success_total{{finished_reason="abort",model_name="{one_lane.model}"}}'
        assert f"{ended} {n}.0" in metrics
        assert httpx.get(f"{one_lane.url}/health").json()["requests_waiting"] == 0


def test_when_one_choice_fails_the_others_are_aborted_and_nothing_is_left_waiting_on_them():
    """n 3, the first choice's draw failing at once (a 400), the others never answered: as the front-end process's
    handle drops the last update of a request it has aborted, their collections must be cancelled, not left
    waiting for ever."""
    import asyncio

    from server.app import ServerState, build_app
    from server.engine import Update
    from tests.server.test_generation import RecordingEngine

    class FirstFails(RecordingEngine):
        def submit(self, request) -> None:
            super().submit(request)
            if len(self.submitted) == 1:
                request.sink(Update((), "error", "the token draw failed", error_param="temperature"))

    async def main():
        engine = FirstFails()
        app = build_app(ServerState(engine, None, "m", 256, 512, (0,)))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://flashnext") as http:
            response = await http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4, "n": 3})
        await asyncio.sleep(0)
        waiting = [task for task in asyncio.all_tasks() if "collect" in repr(task.get_coro())]
        return response, engine, waiting

    response, engine, waiting = asyncio.run(main())
    assert response.status_code == 400 and error_of(response)["param"] == "temperature"
    assert {request_id for request_id, _ in engine.aborts} == {r.request_id for r in engine.submitted[1:]}
    assert waiting == []


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
def test_a_client_that_leaves_while_sending_its_body_ends_its_request_quietly(path):
    """A body cut off by the client's leaving is answered 499 (to no one), not raised from the app: uvicorn logged
    each one as an exception in the ASGI application, with its traceback."""
    import asyncio

    from server.app import ServerState, build_app
    from tests.server.test_generation import RecordingEngine

    app = build_app(ServerState(RecordingEngine(), None, "m", 256, 512, (0,)))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": [],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}  # fmt: skip
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499


def wait_for_running(live: Live, done, timeout_s: float = 10.0) -> int:
    """Poll /health until its requests_running satisfies `done` or the time is up; the last count seen."""
    deadline = time.monotonic() + timeout_s
    while True:
        running = httpx.get(f"{live.url}/health").json()["requests_running"]
        if done(running) or time.monotonic() > deadline:
            return running
        time.sleep(0.05)


@pytest.mark.parametrize(
    "body", ['{"prompt": "a\\ud800b"}', '{"messages": [{"role": "user", "content": "a\\ud800b"}]}']
)
def test_tokenize_refuses_a_lone_surrogate_as_the_completion_routes_do(live, body):
    """JSON's \\ud800 escape alone is no Unicode text: /tokenize answers a 400 (the tokenizer raised a 500)."""
    response = httpx.post(f"{live.url}/tokenize", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400 and "not valid JSON" in error_of(response)["message"]
    completion = httpx.post(f"{live.v1}/completions", content=body, headers={"content-type": "application/json"})
    assert completion.status_code == 400


@pytest.mark.parametrize("route", ["/tokenize", "/detokenize"])
def test_tokenize_and_detokenize_check_the_model_as_the_completion_routes_do(live, route):
    """Another model's name is a 404 on either route (/detokenize ignored it), and a name that is no string a 400
    saying so (/tokenize answered it 404, as if it named another model)."""
    body = {"prompt": "x"} if route == "/tokenize" else {"tokens": [5]}
    other = httpx.post(f"{live.url}{route}", json={**body, "model": "another-model"})
    assert other.status_code == 404 and error_of(other)["param"] == "model"
    number = httpx.post(f"{live.url}{route}", json={**body, "model": 5})
    assert number.status_code == 400 and error_of(number)["param"] == "model"
    assert httpx.post(f"{live.url}{route}", json={**body, "model": live.model}).status_code == 200


def test_version_is_the_packages_and_needs_no_key(monkeypatch):
    """vLLM's /version, public as /health is; from pyproject.toml where the package is run from a checkout."""
    import tomllib
    from importlib.metadata import PackageNotFoundError

    from fastapi.testclient import TestClient

    import server.app
    from server.app import ServerState, build_app
    from tests.server.test_generation import RecordingEngine

    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    http = TestClient(build_app(ServerState(RecordingEngine(), None, "m", 256, 512, (0,), api_key="k")))
    assert http.get("/version").json() == {"version": pyproject["project"]["version"]}

    def not_installed(name: str) -> str:
        raise PackageNotFoundError(name)

    monkeypatch.setattr(server.app, "package_version", not_installed)
    assert http.get("/version").json() == {"version": pyproject["project"]["version"]}
    assert http.get("/v1/models").status_code == 401


def test_api_key_is_required_when_set(ckpt):
    with serve(ckpt, "--api-key", "sesame") as keyed:
        with pytest.raises(openai.AuthenticationError):
            client(keyed, api_key="wrong").models.list()
        assert [m.id for m in client(keyed, api_key="sesame").models.list()] == [keyed.model]
        assert httpx.get(f"{keyed.url}/health").status_code == 200


def test_live_lanes_keep_decoding_while_a_long_prompt_fills_in_chunks(ckpt, live):
    long_prompt = [(7 * i) % 300 + 6 for i in range(160)]
    whole = seeded(live, 77, long_prompt, 6)  # the default budget reads this prompt in one round
    with serve(ckpt, "--prompt-budget", "8") as chunked:
        events: list[str] = []
        started = threading.Event()

        def short_stream() -> None:
            body = {"prompt": PROMPT, "max_tokens": 60, "stream": True, "ignore_eos": True, "temperature": 0}
            with httpx.stream("POST", f"{chunked.v1}/completions", json=body, timeout=120) as response:
                for line in response.iter_lines():
                    if '"text"' in line:
                        events.append("short")
                        started.set()

        reader = threading.Thread(target=short_stream)
        reader.start()
        assert started.wait(60)
        events.append("long submitted")
        body = {
            "prompt": long_prompt,
            "max_tokens": 6,
            "temperature": 1.0,
            "seed": 77,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with httpx.stream("POST", f"{chunked.v1}/completions", json=body, timeout=120) as response:
            lines = [line for line in response.iter_lines() if line.startswith("data: {")]
            events.append("long first token")
        reader.join(120)
    between = events[events.index("long submitted") : events.index("long first token")]
    assert between.count("short") >= 10  # 160 prompt tokens at 8 a round: the short stream kept its tokens coming
    assert json.loads(lines[-1][len("data: ") :])["token_sha"] == whole  # chunking does not change the bits


def test_drafted_equals_draft_false_and_drafting_shows_in_metrics(live):
    for body in ({"temperature": 0}, {"temperature": 1.0, "seed": 9}):
        outs = [
            httpx.post(
                f"{live.v1}/completions",
                json={"prompt": PROMPT, "max_tokens": 24, "ignore_eos": True, "draft": draft, **body},
                timeout=120,
            ).json()
            for draft in (True, False)
        ]
        assert outs[0]["token_sha"] == outs[1]["token_sha"]
    health = httpx.get(f"{live.url}/health").json()
    assert health["draft_depth"] == 3 and health["draft_tokens"] > 0
    metrics = httpx.get(f"{live.url}/metrics").text
    drafted = [line for line in metrics.splitlines() if line.startswith("flashnext:spec_decode_num_draft_tokens_total")]
    assert drafted and float(drafted[0].split()[-1]) > 0
    assert "flashnext:spec_decode_num_accepted_tokens_total" in metrics
    first = [line for line in metrics.splitlines() if line.startswith("flashnext:spec_decode_num_draft_tokens_per_pos")]
    assert first and first[0].startswith(
        f'flashnext:spec_decode_num_draft_tokens_per_pos_total{{model_name="{live.model}",position="0"}}'
    )
    assert len(health["draft_acceptance_per_position"]) == 3 and health["draft_acceptance_per_position"][0] is not None


def test_a_long_chat_keeps_states_at_its_last_message_ends_only():
    """Each message end costs a render of the messages up to it: all of a conversation's would cost the square of
    its length (800 messages within the context took seconds of the front end's time); the last few are the ones
    the next turn resumes from."""
    from fastapi.testclient import TestClient

    from server.app import MESSAGE_KEEPS, ServerState, build_app
    from server.engine import Update
    from tests.server.test_generation import RecordingEngine

    class Caching(RecordingEngine):
        cache_enabled = True

        def submit(self, request) -> None:
            super().submit(request)
            request.sink(Update((), "length"))

    engine, tokenizer = Caching(), CountingTokenizer()
    http = TestClient(build_app(ServerState(engine, tokenizer, "m", 256, 512, (0,))))
    response = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}] * 100})
    assert response.status_code == 200
    assert tokenizer.renders == 1 + MESSAGE_KEEPS
    assert engine.submitted[0].keep_at == tuple(range(100 - MESSAGE_KEEPS, 100))


def families(live: Live) -> dict:
    """The /metrics exposition parsed as Prometheus parses it: family name -> family."""
    return {family.name: family for family in text_string_to_metric_families(httpx.get(f"{live.url}/metrics").text)}


def test_tokenize_return_token_strs_gives_the_token_strings(live):
    """vLLM's /tokenize with return_token_strs: true answers token_strs, the tokenizer's convert_ids_to_tokens of the
    ids (prompt and messages forms alike)."""
    tokenizer = AutoTokenizer.from_pretrained(live.path)
    for body in ({"prompt": "def add(a, b):"}, {"messages": [{"role": "user", "content": "hi"}]}):
        out = httpx.post(f"{live.url}/tokenize", json={**body, "return_token_strs": True}).json()
        assert out.get("token_strs") == tokenizer.convert_ids_to_tokens(out["tokens"]), body
    unasked = httpx.post(f"{live.url}/tokenize", json={"prompt": "ab", "return_token_strs": None})  # vLLM's default
    assert unasked.status_code == 200 and unasked.json()["token_strs"] is None


def test_stream_options_without_include_usage_still_gives_usage_as_vllms(live):
    """vLLM's StreamOptions.include_usage defaults to true: stream_options {"continuous_usage_stats": true} alone gives
    every chunk its usage so far and ends the stream with the usage-only chunk."""
    body = {"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True, "stream_options": {"continuous_usage_stats": True}}
    chunks = sse_chunks(live, "completions", body)
    assert all(chunk.get("usage") is not None for chunk in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4


def test_prefix_cache_queries_and_hits_are_counters_in_tokens(live):
    """vLLM's vllm:prefix_cache_queries and vllm:prefix_cache_hits are counters (scraped as *_total) counting queried
    and hit prompt tokens, which dashboards take rate() of."""
    prompt = list(range(5, 60))
    for _ in range(2):  # the second resumes the first's kept prefix
        httpx.post(f"{live.v1}/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=120).raise_for_status()
    found = families(live)
    for name in ("flashnext:prefix_cache_queries", "flashnext:prefix_cache_hits"):
        assert name in found and found[name].type == "counter", (name, found.get(name))
    queried = found["flashnext:prefix_cache_queries"].samples[0].value
    assert queried >= 2 * len(prompt)  # tokens queried, not lookups


def test_metrics_carry_the_model_name_label_as_vllms(live):
    """Every vLLM metric is labelled model_name (vLLM's Grafana dashboard filters each query by
    {model_name="$model_name"})."""
    httpx.post(f"{live.v1}/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=120).raise_for_status()
    found = families(live)
    for name in (
        "flashnext:num_requests_running",
        "flashnext:num_requests_waiting",
        "flashnext:prompt_tokens",
        "flashnext:generation_tokens",
        "flashnext:time_to_first_token_seconds",
        "flashnext:request_success",
    ):
        samples = [s for s in found[name].samples if not s.name.endswith("_created")]
        assert samples and all(s.labels.get("model_name") == live.model for s in samples), (name, samples[:2])


def test_metrics_have_vllms_request_histograms(live):
    """vLLM exposes vllm:e2e_request_latency_seconds (the dashboard's "E2E Request Latency" panel) and the per-request
    vllm:request_prompt_tokens / vllm:request_generation_tokens histograms; a finished request is observed in each."""
    httpx.post(f"{live.v1}/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=120).raise_for_status()
    found = families(live)
    for name in (
        "flashnext:e2e_request_latency_seconds",
        "flashnext:request_prompt_tokens",
        "flashnext:request_generation_tokens",
    ):
        assert name in found and found[name].type == "histogram", name
        count = [s.value for s in found[name].samples if s.name == f"{name}_count"]
        assert count and count[0] >= 1, (name, count)


@pytest.mark.parametrize(("method", "path"), [("GET", "/v1/nothing"), ("GET", "/v1/chat/completions")])
def test_unknown_routes_and_methods_answer_openais_error_shape(live, method, path):
    """A route or method that does not exist gets its 404/405 with OpenAI's {"error": {"message", "type", "param",
    "code"}} body (design.md section 8), not FastAPI's {"detail": ...}."""
    response = httpx.request(method, f"{live.url}{path}")
    assert response.status_code in (404, 405)
    error = response.json().get("error")
    assert isinstance(error, dict) and set(error) >= {"message", "type", "param", "code"}, response.json()
