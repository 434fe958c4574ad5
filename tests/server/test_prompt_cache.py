"""The prompt cache: a resumed prompt equals the same prompt served fresh, at any kept boundary."""

from __future__ import annotations

import importlib.util
import json
import threading
from pathlib import Path

import httpx
import pytest

from server.prompt_cache import Kept, PromptCache, prefix_digests
from tests.server.live import Live, serve, tiny_chat_checkpoint

ROOT = Path(__file__).resolve().parents[2]
LONG = [(13 * i) % 300 + 6 for i in range(40)]
CHAT = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list."}]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return tiny_chat_checkpoint(tmp_path_factory.mktemp("cache") / "tiny-chat")


@pytest.fixture(scope="module")
def servers(ckpt):
    """A server keeping states every 8 tokens, and a fresh reference with the cache off."""
    with serve(ckpt, "--prompt-cache-grid", "8") as cached, serve(ckpt, "--prompt-cache-gib", "0") as fresh:
        yield cached, fresh


def complete(live: Live, prompt, **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, **extra}
    return httpx.post(f"{live.v1}/completions", json=body, timeout=120).json()


def chat(live: Live, messages, **extra) -> dict:
    body = {"messages": messages, "max_tokens": 10, "temperature": 0, "ignore_eos": True, **extra}
    return httpx.post(f"{live.v1}/chat/completions", json=body, timeout=120).json()


def cached(out: dict) -> int:
    return out["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_the_cache_keeps_its_byte_total_through_adds_replacements_and_evictions() -> None:
    cache = PromptCache(100)
    assert cache.add(b"a", Kept(1, 4, 40)) == [] and cache.nbytes == 40
    assert cache.add(b"b", Kept(2, 8, 50)) == [] and cache.nbytes == 90
    assert cache.add(b"a", Kept(3, 4, 30)) == [] and cache.nbytes == 80  # a prefix kept again replaces its entry
    assert cache.add(b"c", Kept(4, 9, 60)) == [2]  # b is the least recently used
    assert cache.nbytes == 90 == sum(e.nbytes for e in cache.entries.values())
    assert cache.add(b"d", Kept(5, 9, 101)) == [3, 4, 5] and cache.nbytes == 0 and not cache.entries


@pytest.mark.parametrize(
    "sampling",
    [
        {},
        {"temperature": 1.0, "seed": 77},
        {"repetition_penalty": 1.7, "frequency_penalty": 0.4, "presence_penalty": 0.2},
    ],
    ids=["greedy", "seeded", "penalized"],  # a repetition penalty counts the resumed prefix's ids too
)
@pytest.mark.parametrize("draft", [True, False], ids=["drafted", "serial"])
def test_a_prompt_resumed_at_a_grid_boundary_equals_it_fresh(servers, sampling, draft):
    on, off = servers
    complete(on, LONG, draft=draft, **sampling)
    # shares 21 tokens with LONG (the grid kept 8 and 16 of them); the tail is this case's own
    branch = [*LONG[:21], 7 + 2 * len(sampling) + int(draft), 8, 9, 10, 11]
    resumed, fresh = complete(on, branch, draft=draft, **sampling), complete(off, branch, draft=draft, **sampling)
    assert cached(resumed) == 16 and cached(fresh) == 0
    assert resumed["token_sha"] == fresh["token_sha"]


def test_a_cache_salt_keeps_its_requests_prompt_states_apart(servers):
    """vLLM's cache_salt: a prompt resumes only states kept under the same salt (none is a salt of its own)."""
    on, off = servers
    prompt = [6, *LONG[5:30]]
    first = complete(on, prompt, cache_salt="alice")
    other, unsalted = complete(on, prompt, cache_salt="bob"), complete(on, prompt)
    again = complete(on, prompt, cache_salt="alice")
    assert (cached(first), cached(other), cached(unsalted), cached(again)) == (0, 0, 0, len(prompt) - 1)
    assert len({out["token_sha"] for out in (first, other, unsalted, again, complete(off, prompt))}) == 1
    empty = httpx.post(f"{on.v1}/completions", json={"prompt": prompt, "cache_salt": ""}, timeout=60)
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "cache_salt"


def test_salted_prefix_digests_differ_from_unsalted_and_from_each_other() -> None:
    plain = prefix_digests([5, 9, 14], [1, 3])
    assert plain != prefix_digests([5, 9, 14], [1, 3], salt="a") != prefix_digests([5, 9, 14], [1, 3], salt="b")
    assert prefix_digests([5, 9, 14], [3], salt="a")[3] == prefix_digests([5, 9, 14], [1, 3], salt="a")[3]


def test_the_same_prompt_again_resumes_one_token_before_its_end(servers):
    on, off = servers
    prompt = [5, *LONG[3:30]]
    first, again = complete(on, prompt), complete(on, prompt)
    assert cached(first) < cached(again) == len(prompt) - 1
    assert again["token_sha"] == first["token_sha"] == complete(off, prompt)["token_sha"]


def test_multi_turn_chat_reports_growing_cached_tokens_and_fresh_output(servers):
    on, off = servers
    messages, previous = list(CHAT), -1
    for turn in range(3):
        out = chat(on, messages)
        assert out["choices"][0]["message"] == chat(off, messages)["choices"][0]["message"]
        assert out["token_sha"] == chat(off, messages)["token_sha"]
        if turn:
            assert cached(out) > previous
        previous = cached(out)
        reply = out["choices"][0]["message"]["content"] or "ok"
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"And then {turn}?"}]
    # edit the last user message: it resumes just before it
    edited = [*messages[:-1], {"role": "user", "content": "Something else entirely."}]
    out = chat(on, edited)
    assert cached(out) > 0 and out["token_sha"] == chat(off, edited)["token_sha"]


def test_two_concurrent_requests_sharing_a_prefix_equal_their_fresh_runs(servers):
    on, off = servers
    complete(on, LONG[:33])
    prompts = [[*LONG[:25], 100, 101], [*LONG[:26], 200]]
    results = [None, None]
    barrier = threading.Barrier(2)

    def run(i: int) -> None:
        barrier.wait()
        results[i] = complete(on, prompts[i], temperature=1.0, seed=i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for prompt, out in zip(prompts, results, strict=True):
        assert cached(out) == 24
        assert out["token_sha"] == complete(off, prompt, temperature=1.0, seed=prompts.index(prompt))["token_sha"]


def test_a_tiny_budget_evicts_and_keeps_serving_correct_output(ckpt, servers):
    _, off = servers
    with serve(ckpt, "--prompt-cache-gib", "0.0002", "--prompt-cache-grid", "4") as tiny:
        outs = [complete(tiny, LONG[: 20 + i]) for i in range(6)]
        health = httpx.get(f"{tiny.url}/health").json()["prompt_cache"]
        assert 0 < health["bytes"] <= health["budget_bytes"]
        assert health["entries"] < 6 * 5  # most of the states kept along the way were evicted
        for i, out in enumerate(outs):
            assert out["token_sha"] == complete(off, LONG[: 20 + i])["token_sha"]


def test_cache_figures_in_health_and_metrics(servers):
    """The figures count this test's own hit, whichever of the module's tests ran before it on this worker."""
    on, _ = servers
    before = httpx.get(f"{on.url}/health").json()["prompt_cache"]
    prompt = [11, *LONG[5:25]]
    complete(on, prompt)
    assert cached(complete(on, prompt)) == len(prompt) - 1
    health = httpx.get(f"{on.url}/health").json()["prompt_cache"]
    assert health["hits"] > before["hits"] and health["queries"] >= before["queries"] + 2
    assert health["cached_tokens"] >= before["cached_tokens"] + len(prompt) - 1
    metrics = httpx.get(f"{on.url}/metrics").text
    for name in ("queries_total", "hits_total", "bytes"):
        assert f"flashnext:prefix_cache_{name}{{" in metrics


def test_bench_cache_qualifies_a_reusing_server(servers, tmp_path):
    on, off = servers
    spec = importlib.util.spec_from_file_location("bench_cache", ROOT / "scripts" / "bench_cache.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    ids = ",".join(map(str, [9, *LONG[5:35]]))
    common = ["--prompt-ids", ids, "--tokens", "4", "--repeats", "2", "--streams", "2"]
    assert bench.main(["--base-url", on.url, *common, "--require-cold", "--require-reuse"]) == 0
    assert bench.main(["--base-url", off.url, *common, "--require-reuse"]) == 1
    report = tmp_path / "extend.json"
    extend = ["--random-prompt", "40", "--vocab", "300", "--extend", "6", "--tokens", "3", "--repeats", "2"]
    assert bench.main(["--base-url", on.url, *extend, "--streams", "1", "--json", str(report), "--require-reuse"]) == 0
    runs = json.loads(report.read_text())
    opening = {"choices": [{"index": 0, "text": "", "finish_reason": None}]}  # the stream's first, empty chunk
    assert not bench.carries_tokens(opening) and not bench.carries_tokens({"choices": [], "usage": {}})
    assert bench.carries_tokens({"choices": [{"index": 0, "text": "", "token_ids": [17]}]})
    assert runs["first"]["prompt_tokens"] == 40 and runs["repeats"][0]["prompt_tokens"] == 46
    assert runs["repeats"][0]["cached_tokens"] >= 39  # the next turn resumed the first prompt's kept state


def test_the_index_takes_the_longest_kept_prefix_and_evicts_least_recent():
    cache = PromptCache(300)
    prompt = list(range(50, 90))
    digests = prefix_digests(prompt, [10, 20, 30])
    assert cache.add(digests[10], Kept(1, 10, 100)) == []
    assert cache.add(digests[20], Kept(2, 20, 100)) == []
    assert cache.lookup(prompt).handle == 2
    assert cache.lookup(prompt[:20]).handle == 1  # a prefix must leave one token to run
    assert cache.add(digests[30], Kept(3, 30, 150)) == [2]  # handle 1 was used last, so 2 goes
    assert cache.lookup([*prompt[:15], 0, 0, 0, 0, 0, 0]).handle == 1
    assert PromptCache(0).lookup(prompt) is None


def serve_in_turn(model, requests, prompt_cache: PromptCache, runner_class=None) -> tuple[list, object]:
    """Run (prompt, draft) requests one after another on one engine; each one's Outcome, and the runner."""
    from rankwire.header import DrawSpec
    from server.engine import Engine, Request
    from tests.server.engine_harness import Outcome, RecordingRunner

    runner = (runner_class or RecordingRunner)(model, 1)
    engine = runner.engine = Engine(runner, 4096, 64, draft_depth=3, prompt_cache=prompt_cache, cache_grid=8)
    engine.start()
    outcomes = []
    try:
        for i, (prompt, draft) in enumerate(requests):
            outcomes.append(Outcome())
            draw = DrawSpec(0.0, 0, 1.0, 0.0, 1)
            engine.submit(Request(f"r{i}", prompt, 6, draw, frozenset(), outcomes[-1].sink, draft=draft))
            assert outcomes[-1].done.wait(120)
    finally:
        engine.stop()
    return outcomes, runner


def test_a_drafting_request_resumes_a_state_kept_by_an_undrafted_one(ckpt):
    from model.weights import load_model

    model = load_model(ckpt, dtype="float32")
    cached, _ = serve_in_turn(model, [(LONG[:20], False), (LONG[:25], True)], PromptCache(1 << 30))
    (fresh,), _ = serve_in_turn(model, [(LONG[:25], True)], PromptCache(0))
    assert [o.finish for o in cached] == ["length", "length"]
    assert cached[1].tokens == fresh.tokens


def test_a_failed_round_loses_its_keeps_and_the_engine_goes_on(ckpt):
    from model.weights import load_model
    from tests.server.engine_harness import RecordingRunner

    class FailsOnce(RecordingRunner):
        failed = False

        def launch(self, plan, launched=None):
            if not self.failed and any(op.after for op in plan.ops):
                self.failed = True
                raise RuntimeError("injected")
            return super().launch(plan, launched)

    model = load_model(ckpt, dtype="float32")
    outcomes, _ = serve_in_turn(model, [(LONG[:20], True), (LONG[:20], True)], PromptCache(1 << 30), FailsOnce)
    assert [o.finish for o in outcomes] == ["error", "length"]


def test_a_launch_that_failed_before_its_drops_asks_for_them_again(ckpt):
    """A 1-byte cache evicts every state it is given, so the next plan carries their drops; that launch fails
    before applying them (as one failing to allocate its lane does). Every state the runner still holds must be
    named by the cache or have its drop asked again: none is left outside the cache's budget for good."""
    from model.weights import load_model
    from rankwire.header import LaneOpCode
    from tests.server.engine_harness import RecordingRunner

    class FailsBeforeItsDrops(RecordingRunner):
        failed = False

        def launch(self, plan, launched=None):
            if not self.failed and any(op.code is LaneOpCode.DROP for op in plan.ops):
                self.failed = True
                raise RuntimeError("out of memory (injected)")
            return super().launch(plan, launched)

    cache = PromptCache(1)
    prompts = [(LONG[:20], False), (LONG[5:25], False), (LONG[10:30], False)]
    outcomes, runner = serve_in_turn(load_model(ckpt, dtype="float32"), prompts, cache, FailsBeforeItsDrops)
    assert runner.failed and [o.finish for o in outcomes] == ["error", "length", "length"]
    named = {kept.handle for kept in cache.entries.values()}
    asked = {op.arg for op in runner.engine.ops if op.code is LaneOpCode.DROP}
    assert set(runner.kept) - named - asked == set()


def test_a_resumed_prompt_reaches_its_first_token_in_one_round(ckpt):
    from model.weights import load_model

    model = load_model(ckpt, dtype="float32")
    _, runner = serve_in_turn(model, [(LONG[:20], False), (LONG[:25], False)], PromptCache(1 << 30))
    second = [plan for plan in runner.plans if plan.allocate][1]  # the second request's first round
    assert second.rows[0].start == 19 and second.rows[0].draw is not None  # resumed, then one pass to the draw
    keeps = [op for op in second.ops if op.code.name == "KEEP"]
    assert [op.after for op in keeps] == [5]  # the grid boundary at 24, one before the end, kept inside the round
