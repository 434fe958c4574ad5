"""Exactness of the API's sampling extensions on a served model: n choices, logprobs, logit_bias, min_tokens,
penalties, allowed_token_ids, prompt_logprobs, batches of prompts, echo, the Responses API and guided decoding (an EBNF
grammar too), each drafted and undrafted, streamed and not; and bad_words. Prints PASS or FAIL per check; exits 1 on
any failure.

Usage: python3 scripts/gpu_api_check.py --base-url http://127.0.0.1:8601
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from decimal import Decimal

import httpx

PROMPT = "def merge_sorted(left, right):\n    "
NESTED_LISTS = 'root ::= "[" item (", " item)* "]"\nitem ::= [a-z_]+ | [0-9]+ | root'  # an EBNF grammar, recursive


def complete(base: str, **fields) -> dict:
    """A text completion's response (streamed chunks merged per choice into one response's shape)."""
    body = {"prompt": PROMPT, "max_tokens": 32, "ignore_eos": True, "return_token_ids": True, **fields}
    if not body.get("stream"):
        return httpx.post(f"{base}/v1/completions", json=body, timeout=300).json()
    choices: dict[int, dict] = {}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=300) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                merged = choices.setdefault(choice["index"], {"token_ids": [], "logprobs": {}})
                merged["token_ids"] += choice.get("token_ids", [])
                for key, values in (choice.get("logprobs") or {}).items():
                    merged["logprobs"][key] = merged["logprobs"].get(key, []) + values
    return {"choices": [choices[i] for i in sorted(choices)]}


def shown(response: dict) -> list:
    """Each choice's tokens and logprobs (token_logprobs and top ones), what the checks compare."""
    return [
        (c["token_ids"], (c.get("logprobs") or {}).get("token_logprobs"), (c.get("logprobs") or {}).get("top_logprobs"))
        for c in response["choices"]
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True)
    base = parser.parse_args().base_url
    failures = 0

    def check(name: str, ok: bool, detail: object = "") -> None:
        nonlocal failures
        failures += not ok
        print(f"{'PASS' if ok else 'FAIL'} {name}" + ("" if ok else f": {detail}"), flush=True)

    sampled = {"temperature": 0.8, "seed": 11}
    together = shown(complete(base, n=4, **sampled))
    alone = [shown(complete(base, temperature=0.8, seed=11 + i))[0] for i in range(4)]
    check("n=4: choice i = the request alone with seed + i", together == alone)
    check("n=4: choices differ", len({tuple(c[0]) for c in together}) == 4)
    check("n=4 streamed = not streamed", shown(complete(base, n=4, stream=True, **sampled)) == together)
    for name, fields in (("greedy", {"temperature": 0}), ("sampled", sampled)):
        drafted = shown(complete(base, logprobs=5, **fields))
        undrafted = shown(complete(base, logprobs=5, draft=False, **fields))
        streamed = shown(complete(base, logprobs=5, stream=True, **fields))
        check(f"logprobs {name}: drafted = undrafted = streamed", drafted == undrafted == streamed)
        check(f"logprobs {name}: one per token", len(drafted[0][1]) == len(drafted[0][0]) == 32)
    plain = shown(complete(base, temperature=0))[0][0]
    bias = {str(plain[0]): -100, str(plain[4]): -4.5, "17": 3.25}
    drafted = shown(complete(base, temperature=0, logit_bias=bias))
    check(
        "logit_bias: drafted = undrafted", drafted == shown(complete(base, temperature=0, draft=False, logit_bias=bias))
    )
    check("logit_bias: output moved", drafted[0][0] != plain and drafted[0][0][0] != plain[0])
    forced = shown(complete(base, **sampled, logit_bias={str(plain[7]): 100}))[0][0]
    check("logit_bias +100: every token the biased one", forced == [plain[7]] * 32, forced[:8])
    stop = plain[1]  # min_tokens 8 keeps this stop token out of the first 8 tokens, and lets it end the output after
    held = [shown(complete(base, temperature=0, stop_token_ids=[stop], min_tokens=8, **extra))[0][0]
            for extra in ({}, {"draft": False})]  # fmt: skip
    check("min_tokens: drafted = undrafted", held[0] == held[1])
    check("min_tokens: no stop token before 8 tokens", stop not in held[0][:8] and len(held[0]) >= 8, held[0])
    penalties = {"repetition_penalty": 1.3, "frequency_penalty": 0.6, "presence_penalty": 0.4}
    for name, fields in (("greedy", {"temperature": 0}), ("sampled", sampled)):
        runs = [shown(complete(base, max_tokens=64, **penalties, **fields, **extra))[0][0]
                for extra in ({}, {"draft": False}, {"stream": True})]  # fmt: skip
        check(f"penalties {name}: drafted = undrafted = streamed", runs[0] == runs[1] == runs[2])
        unpenalized = shown(complete(base, max_tokens=64, **fields))[0][0]
        check(f"penalties {name}: output moved", runs[0] != unpenalized)
    beside = shown(complete(base, n=3, max_tokens=64, **penalties, **sampled))
    alone = [shown(complete(base, max_tokens=64, **penalties, temperature=0.8, seed=11 + i))[0] for i in range(3)]
    check("penalties: n=3 choices = each alone", beside == alone)
    allowed = sorted({*plain[:6], 17, 99})
    runs = [shown(complete(base, temperature=0, allowed_token_ids=allowed, **extra))[0][0]
            for extra in ({}, {"draft": False}, {"stream": True})]  # fmt: skip
    check("allowed_token_ids: drafted = undrafted = streamed", runs[0] == runs[1] == runs[2])
    check("allowed_token_ids: only allowed ids", set(runs[0]) <= set(allowed), runs[0][:8])
    ids = complete(base, max_tokens=1, return_token_ids=True)["choices"][0]["prompt_token_ids"]
    prompt = (ids * 40)[:300]  # three passes of at most 128 rows
    entries = [
        complete(base, prompt=p, max_tokens=1, prompt_logprobs=3)["choices"][0]["prompt_logprobs"]
        for p in (prompt, prompt[:128])
    ]  # fmt: skip  (128: whole GDN chunks, cut alike in both)
    check("prompt_logprobs: one per prompt token", len(entries[0]) == 300 and entries[0][0] is None)
    check("prompt_logprobs: the first 128 the same alone and inside 300", entries[0][:128] == entries[1])
    batch = [PROMPT, "class Stack:\n    ", "import os\n"]
    together = shown(complete(base, prompt=batch, n=2, **sampled))
    alone = [c for p in batch for c in shown(complete(base, prompt=p, n=2, **sampled))]
    check("batch of 3 prompts, n=2: choice i * 2 + j = prompt i alone", together == alone)
    check("batch streamed = not streamed", shown(complete(base, prompt=batch, n=2, stream=True, **sampled)) == together)
    echoed = complete(base, echo=True, logprobs=2, max_tokens=4, temperature=0)["choices"][0]["logprobs"]
    prompt_only = complete(base, echo=True, logprobs=2, max_tokens=0)["choices"][0]["logprobs"]
    width = len(prompt_only["tokens"])
    check("echo, max_tokens 0: the prompt's logprobs as echo gives them before an answer",
          all(prompt_only[key] == echoed[key][:width] for key in ("tokens", "token_logprobs", "top_logprobs"))
          and len(echoed["tokens"]) == width + 4)  # fmt: skip
    streamed_echo = complete(base, echo=True, logprobs=2, max_tokens=4, temperature=0, stream=True)
    check("echo with logprobs: streamed = not streamed",
          streamed_echo["choices"][0]["logprobs"]["token_logprobs"] == echoed["token_logprobs"])  # fmt: skip
    ask = {"instructions": "Answer in Python.", "input": "Reverse a list.", "max_output_tokens": 48, **sampled}
    response = httpx.post(f"{base}/v1/responses", json=ask, timeout=300).json()
    text = "".join(part["text"] for item in response["output"] if item["type"] == "message" for part in item["content"])
    messages = [{"role": "system", "content": ask["instructions"]}, {"role": "user", "content": ask["input"]}]
    chat = httpx.post(f"{base}/v1/chat/completions", json={"messages": messages, "max_tokens": 48, **sampled},
                      timeout=300).json()  # fmt: skip
    check("responses: the text of the equivalent chat", text == chat["choices"][0]["message"]["content"], text[:60])
    with httpx.stream("POST", f"{base}/v1/responses", json={**ask, "stream": True}, timeout=300) as streamed:
        events = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: ")]
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    last = events[-1]["type"]
    check("responses: streamed = not streamed", deltas == text and last == f"response.{response['status']}", last)
    for name, fields in (("greedy", {"temperature": 0}), ("sampled", sampled)):
        answer = complete(base, max_tokens=64, **fields)
        words = list(dict.fromkeys(re.findall("[A-Za-z]{3,}", answer["choices"][0]["text"])))[:2]  # its first words
        spelled = [httpx.post(f"{base}/tokenize", json={"prompt": text}, timeout=60).json()["tokens"]
                   for word in words for text in (word, " " + word)]  # fmt: skip
        runs = [complete(base, max_tokens=64, bad_words=words, **fields, **extra)
                for extra in ({}, {"draft": False}, {"stream": True})]  # fmt: skip
        check(f"bad_words {name}: drafted = undrafted = streamed", shown(runs[0]) == shown(runs[1]) == shown(runs[2]))
        plain, ids = shown(answer)[0][0], shown(runs[0])[0][0]
        held = [[seq for seq in spelled if any(out[i : i + len(seq)] == seq for i in range(len(out)))]
                for out in (plain, ids)]  # fmt: skip
        check(f"bad_words {name}: the plain answer holds them, this one none", held[0] and not held[1], held)
    guided_checks(base, check)
    return 1 if failures else 0


SCORE = {"type": "number", "multipleOf": 0.25, "minimum": 0, "maximum": 4}


def guided_checks(base: str, check) -> None:
    """Guided decoding: each output follows its grammar; drafted = undrafted = streamed; n choices = each alone."""
    regex, choices = "[a-z]{2,8}_[0-9]{1,3}", ["merge", "sort", "split"]
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                               "sizes": {"type": "array", "items": {"type": "integer"}, "maxItems": 4}},
              "required": ["name", "sizes"]}  # fmt: skip
    bounded = {"type": "object", "properties": {"day": {"type": "string", "format": "date"},
                                                "count": {"type": "integer", "minimum": 1, "maximum": 9},
                                                "ratio": {"type": "number", "minimum": 0, "exclusiveMaximum": 1}},
               "required": ["day", "count", "ratio"]}  # fmt: skip
    base_record = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}},
                   "required": ["id"]}  # fmt: skip
    scores = {"type": "object", "propertyNames": {"enum": ["a", "b", "c"]}, "minProperties": 1,
              "additionalProperties": SCORE}  # fmt: skip
    derived = {"type": "object", "properties": {"scores": scores}, "required": ["scores"],
               "additionalProperties": True}  # fmt: skip
    objects = {"$defs": {"Base": base_record}, "allOf": [{"$ref": "#/$defs/Base"}, derived]}
    for name, guide, fits in (
        ("guided_json bounds", {"guided_json": bounded}, lambda text: within_bounds(json.loads(text))),
        (
            "guided_json objects",
            {"guided_json": objects},
            lambda text: objects_hold(json.loads(text, parse_float=Decimal)),
        ),
        ("guided_regex", {"guided_regex": regex}, lambda text: re.fullmatch(regex, text)),
        ("guided_choice", {"guided_choice": choices}, lambda text: text in choices),
        ("guided_json", {"guided_json": schema}, lambda text: set(json.loads(text)) == {"name", "sizes"}),
        ("json_object", {"response_format": {"type": "json_object"}}, lambda text: isinstance(json.loads(text), dict)),
        ("guided_grammar", {"guided_grammar": NESTED_LISTS}, nested_list),
    ):
        for draw, fields in (("greedy", {"temperature": 0}), ("sampled", {"temperature": 0.8, "seed": 5})):
            runs = [complete(base, max_tokens=96, ignore_eos=False, **guide, **fields, **extra)
                    for extra in ({}, {"draft": False}, {"stream": True})]  # fmt: skip
            check(f"{name} {draw}: drafted = undrafted = streamed", shown(runs[0]) == shown(runs[1]) == shown(runs[2]))
            text, finish = runs[0]["choices"][0]["text"], runs[0]["choices"][0]["finish_reason"]
            try:
                ok = finish == "length" or bool(fits(text))
            except ValueError:
                ok = False
            check(f"{name} {draw}: the output follows the grammar ({finish})", ok, text[:80])
    sampled = {"temperature": 0.8, "seed": 11, "max_tokens": 96, "ignore_eos": False, "guided_json": schema}
    together = shown(complete(base, n=3, **sampled))
    alone = [shown(complete(base, **{**sampled, "seed": 11 + i}))[0] for i in range(3)]
    check("guided_json: n=3 choices = each alone", together == alone)
    tool = {"type": "function", "function": {"name": "sort_items", "parameters": {
        "type": "object", "properties": {"items": {"type": "array", "items": {"type": "integer"}, "maxItems": 6}},
        "required": ["items"]}}}  # fmt: skip
    for choice in ({"type": "function", "function": {"name": "sort_items"}}, "required"):
        ask = {"messages": [{"role": "user", "content": "Sort 3, 1, 2."}], "tools": [tool], "tool_choice": choice,
               "max_tokens": 96, "temperature": 0, "chat_template_kwargs": {"enable_thinking": False}}  # fmt: skip
        replies = [httpx.post(f"{base}/v1/chat/completions", json={**ask, **extra}, timeout=300).json()
                   for extra in ({}, {"draft": False})]  # fmt: skip
        name = "named" if isinstance(choice, dict) else choice
        check(f"tool_choice {name}: drafted = undrafted", replies[0]["token_sha"] == replies[1]["token_sha"])
        answer = replies[0]["choices"][0]
        calls = answer["message"].get("tool_calls") or []
        ok = answer["finish_reason"] == "length" or (
            len(calls) >= 1 and all(set(json.loads(c["function"]["arguments"])) == {"items"} for c in calls)
        )
        check(f"tool_choice {name}: the answer is calls of the tool ({answer['finish_reason']})", ok, answer)
        whole = [call["function"] for call in calls]
        check(f"tool_choice {name}: streamed calls = not streamed", streamed_calls(base, ask) == whole, whole)


def nested_list(text: str) -> bool:
    """Whether the text is a list NESTED_LISTS takes: its words quoted, it reads as a JSON list."""
    return isinstance(json.loads(re.sub(r"[a-z_]+", r'"\g<0>"', text)), list)


def objects_hold(value: dict) -> bool:
    """Whether the objects schema's record holds: an id of 0 to 99, and 1 to 3 scores keyed a, b or c, each a
    multiple of 0.25 from 0 to 4 (other keys may follow)."""
    scores = value["scores"]
    return (
        type(value["id"]) is int
        and 0 <= value["id"] <= 99
        and 1 <= len(scores) <= 3
        and set(scores) <= {"a", "b", "c"}
        and all(0 <= score <= 4 and Decimal(score) % Decimal("0.25") == 0 for score in scores.values())
    )


def within_bounds(value: dict) -> bool:
    """Whether the bounded schema's record holds: a date, an integer from 1 to 9, a ratio in [0, 1)."""
    return (
        re.fullmatch(r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])", value["day"]) is not None
        and type(value["count"]) is int
        and 1 <= value["count"] <= 9
        and 0 <= value["ratio"] < 1
    )


def streamed_calls(base: str, ask: dict) -> list[dict]:
    """A streamed chat's calls, its `tool_calls` deltas joined by index as OpenAI's clients join them."""
    calls: dict[int, dict] = {}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json={**ask, "stream": True}, timeout=300) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                for entry in choice["delta"].get("tool_calls") or []:
                    call = calls.setdefault(entry["index"], {"name": None, "arguments": ""})
                    call["name"] = call["name"] or entry["function"].get("name")
                    call["arguments"] += entry["function"].get("arguments", "")
    return [calls[index] for index in sorted(calls)]


if __name__ == "__main__":
    sys.exit(main())
