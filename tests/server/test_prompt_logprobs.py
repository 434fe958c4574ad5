"""The prompt's logprobs through the engine: passes of several requests share one round's cap on such rows, and each
request's entries are those it gets alone, at any cut of its prompt."""

from __future__ import annotations

import pytest

from model.weights import load_model
from rankwire.header import DrawSpec
from server.engine import PROMPT_LOGPROB_ROWS
from tests.server.engine_harness import run
from tests.tiny import checkpoint

GREEDY = DrawSpec(0.0, 0, 1.0, 0.0, 1)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(checkpoint(tmp_path_factory.mktemp("prompt-logprobs") / "m"), dtype="float32")


def test_requests_share_a_rounds_rows_and_each_gets_its_entries_alone(model):
    prompts = [[(7 * i * i + 3 * i + k) % 300 + 5 for i in range(n)] for k, n in ((0, 300), (1, 129), (2, 1), (3, 40))]
    together, runner = run(model, prompts, 2, [GREEDY] * 4, draft=False, budget=1024, prompt_logprobs=3)
    flagged = [sum(len(r.token_ids) for r in plan.rows if r.prompt_logprobs is not None) for plan in runner.plans]
    assert max(flagged) == PROMPT_LOGPROB_ROWS and len(runner.plans) > 4  # the cap held, and it cut the prompts
    for prompt, tokens, outcome in zip(prompts, together, runner.outcomes, strict=True):
        (alone,), single = run(model, [prompt], 2, [GREEDY], draft=False, budget=1024, prompt_logprobs=3)
        assert outcome.prompt_logprobs == single.outcomes[0].prompt_logprobs and tokens == alone
        assert [entry.token for entry in outcome.prompt_logprobs] == prompt[1:]
        assert all(len(entry.top) == 3 and entry.rank >= 1 for entry in outcome.prompt_logprobs)
    (plain,), _ = run(model, [prompts[0]], 2, [GREEDY], draft=False, budget=1024)
    assert together[0] == plain  # the draw after a flagged pass is the same as after a plain one
