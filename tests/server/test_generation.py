"""Tests for server/generation.py: a request's output is the same however the engine groups its tokens into updates."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
from transformers import AutoTokenizer

from server.engine import Request, Update
from server.generation import Generation, Outcome, Piece, interleaved
from server.protocol import ApiError, SamplingParams
from tests.server.test_textout import TEXTS, load_script

EOS = "<|endoftext|>"


class RecordingEngine:
    """An EngineHandle that keeps what the generation asks of it and delivers nothing itself."""

    cache_enabled = False
    priority_scheduling = False

    def __init__(self) -> None:
        """No requests and no aborts yet."""
        self.submitted: list[Request] = []
        self.aborts: list[tuple[str, str]] = []

    def submit(self, request: Request) -> None:
        """Keep the request."""
        self.submitted.append(request)

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """Keep the abort and its reason."""
        self.aborts.append((request_id, reason))


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny byte-level BPE tokenizer (vocab 512)."""
    out = tmp_path_factory.mktemp("tok")
    load_script().build_tokenizer(out, 512)
    return AutoTokenizer.from_pretrained(out)


def run(tok: Any, params: SamplingParams, updates: list[Update]) -> tuple[Outcome, list[tuple[str, str]]]:
    """Deliver `updates` to a new generation as the engine would, and collect its outcome and its aborts."""

    async def main() -> tuple[Outcome, list[tuple[str, str]]]:
        engine = RecordingEngine()
        generation = Generation(engine, tok, [5, 6, 7], params, 64, (tok.convert_tokens_to_ids(EOS),), None)
        generation.submit()
        for update in updates:
            generation.queue.put_nowait(update)
        outcome = await generation.collect()
        return outcome, [reason for _, reason in engine.aborts]

    return asyncio.run(main())


def grouped(ids: list[int], finish: str | None, rng: random.Random) -> list[Update]:
    """The ids in updates of one to four tokens (a verify round keeps up to four), the last with `finish`."""
    updates, at = [], 0
    while at < len(ids):
        size = rng.choice((1, 2, 3, 4))
        updates.append(Update(tuple(ids[at : at + size])))
        at += size
    updates[-1] = Update(updates[-1].token_ids, finish)
    return updates


def one_by_one(ids: list[int], finish: str | None) -> list[Update]:
    """The ids one a round, as an undrafted request gets them."""
    return [Update((i,), finish if at == len(ids) - 1 else None) for at, i in enumerate(ids)]


@pytest.mark.parametrize("seed", range(12))
def test_a_stop_string_ends_the_output_at_its_token_however_the_tokens_are_grouped(tok: Any, seed: int) -> None:
    """Drafted = undrafted with stop strings: tokens accepted in the same round after the one that completes a stop
    string are not part of the output, so token ids, usage and token_sha equal the one-token-a-round run's."""
    rng = random.Random(seed)
    text = rng.choice(TEXTS)
    ids = tok.encode(text, add_special_tokens=False)
    start = rng.randrange(1, len(text) // 2)
    stop = text[start : start + rng.choice((1, 2, 3))]
    params = SamplingParams(temperature=0.0, stop=(stop,))
    serial, serial_aborts = run(tok, params, one_by_one(ids, "length"))
    batched, batched_aborts = run(tok, params, grouped(ids, "length", rng))
    assert (batched.token_ids, batched.content, batched.finish_reason, batched.stop_reason) == (
        serial.token_ids,
        serial.content,
        serial.finish_reason,
        serial.stop_reason,
    )
    assert (
        serial.finish_reason == "stop"
        and serial.stop_reason == stop
        and stop not in serial.content
        and text.startswith(serial.content)
    )
    assert len(serial.token_ids) < len(ids)
    assert batched_aborts == serial_aborts == ["stop"]  # the engine counts the request as stopped, not aborted


def test_a_stop_string_completed_by_the_last_tokens_text_ends_the_request_without_an_abort(tok: Any) -> None:
    """The engine ended the request already (length): the stop still ends the text, and no abort is sent."""
    ids = tok.encode("abc def", add_special_tokens=False)
    outcome, aborts = run(tok, SamplingParams(temperature=0.0, stop=("def",)), [Update(tuple(ids), "length")])
    assert (outcome.content, outcome.finish_reason, outcome.token_ids, aborts) == ("abc ", "stop", ids, [])


def test_without_a_stop_string_every_token_and_the_engines_finish_come_through(tok: Any) -> None:
    """No stop string: all tokens, the whole text and the engine's finish reason, in any grouping."""
    text = TEXTS[3]
    ids = tok.encode(text, add_special_tokens=False)
    outcome, aborts = run(tok, SamplingParams(temperature=0.0), grouped(ids, "length", random.Random(3)))
    assert (outcome.token_ids, outcome.content, outcome.finish_reason, aborts) == (ids, text, "length", [])


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_tokens_id_is_kept_and_its_text_only_with_include_stop_str_in_output(tok: Any, include: bool) -> None:
    """As vLLM: the token from stop_token_ids that ended the request is among the ids; its text is left out unless
    include_stop_str_in_output."""
    ids = tok.encode("one two, three", add_special_tokens=False)
    stop_token = ids[-1]
    params = SamplingParams(temperature=0.0, stop_token_ids=(stop_token,), include_stop_str_in_output=include)
    outcome, _ = run(tok, params, grouped(ids, "stop", random.Random(1)))
    assert outcome.token_ids == ids and (outcome.finish_reason, outcome.stop_reason) == ("stop", stop_token)
    assert outcome.content == (tok.decode(ids) if include else tok.decode(ids[:-1]))


def test_include_stop_str_in_output_ends_the_text_after_the_stop_string(tok: Any) -> None:
    """The stop string stays in the text, and the tokens still end at the one that completes it."""
    ids = tok.encode("abc def ghi", add_special_tokens=False)
    params = SamplingParams(temperature=0.0, stop=("def",), include_stop_str_in_output=True)
    serial, _ = run(tok, params, one_by_one(ids, "length"))
    assert serial.content == "abc def" and serial.finish_reason == "stop"
    assert tok.decode(serial.token_ids).endswith("def") and len(serial.token_ids) < len(ids)


def test_include_stop_str_in_output_gives_the_same_output_however_the_tokens_are_grouped(tok: Any) -> None:
    """With the stop string kept in the text, drafted = undrafted still holds."""
    for seed in range(6):
        rng = random.Random(seed)
        text = rng.choice(TEXTS)
        ids = tok.encode(text, add_special_tokens=False)
        start = rng.randrange(1, len(text) // 2)
        params = SamplingParams(temperature=0.0, stop=(text[start : start + 2],), include_stop_str_in_output=True)
        serial, _ = run(tok, params, one_by_one(ids, "length"))
        batched, _ = run(tok, params, grouped(ids, "length", rng))
        assert serial.content.endswith(text[start : start + 2]) and len(serial.token_ids) < len(ids)
        assert (batched.token_ids, batched.content) == (serial.token_ids, serial.content)


def test_an_eos_that_ends_the_request_is_among_the_ids_and_not_in_the_text(tok: Any) -> None:
    ids = [*tok.encode("done.", add_special_tokens=False), tok.convert_tokens_to_ids(EOS)]
    outcome, aborts = run(tok, SamplingParams(temperature=0.0), grouped(ids, "stop", random.Random(0)))
    assert (outcome.token_ids, outcome.content, outcome.finish_reason, aborts) == (ids, "done.", "stop", [])
    assert outcome.stop_reason is None  # vLLM's: EOS is no stop string or stop token of the request's


@pytest.mark.parametrize("grouping", ["one by one", "grouped"])
def test_a_stop_string_ends_the_output_only_where_it_ends_after_the_first_min_tokens_tokens(tok: Any, grouping) -> None:
    """A stop string ends the output where it ends in the text of the tokens after the first min_tokens (one that
    begins in their text counts, as vLLM's search reaches back over it), however the tokens are grouped; one that
    ends inside their text does not."""
    ids = tok.encode("abc def abc xyz", add_special_tokens=False)
    first = len(tok.encode("abc def", add_special_tokens=False))  # " abc" begins in the token after these
    ends = next(j for j in range(len(ids)) if tok.decode(ids[: j + 1]).endswith("def abc"))  # and ends in this one
    assert ends > first  # it spans tokens: min_tokens between them leaves its start unwatched
    for min_tokens in range(first, ends + 2):
        params = SamplingParams(temperature=0.0, stop=(" abc",), min_tokens=min_tokens)
        updates = one_by_one(ids, "length") if grouping == "one by one" else grouped(ids, "length", random.Random(2))
        outcome, _ = run(tok, params, updates)
        assert outcome.content == ("abc def" if min_tokens <= ends else "abc def abc xyz"), min_tokens
        assert outcome.finish_reason == ("stop" if min_tokens <= ends else "length")
    unwatched, _ = run(tok, SamplingParams(temperature=0.0, stop=("abc",)), one_by_one(ids, "length"))
    assert unwatched.content == ""


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_an_eos_the_request_also_lists_as_a_stop_token_is_reported_as_eos_unless_eos_is_ignored(tok, ignore_eos):
    """vLLM checks EOS first: its stop_reason stays null; with ignore_eos the id stops the request as a stop token."""
    eos = tok.convert_tokens_to_ids(EOS)
    ids = [*tok.encode("done.", add_special_tokens=False), eos]
    params = SamplingParams(temperature=0.0, stop_token_ids=(eos,), ignore_eos=ignore_eos)
    outcome, _ = run(tok, params, grouped(ids, "stop", random.Random(0)))
    assert (outcome.finish_reason, outcome.stop_reason) == ("stop", eos if ignore_eos else None)


@pytest.mark.parametrize(("refused", "status"), [(True, 503), (False, 500)])
def test_an_error_is_503_if_the_engine_took_no_work_else_500(tok: Any, refused: bool, status: int) -> None:
    update = Update((), "error", "the server is shutting down", refused=refused)
    with pytest.raises(ApiError) as caught:
        run(tok, SamplingParams(), [update])
    assert caught.value.status == status


def test_an_error_the_requests_own_field_caused_is_a_400_naming_it(tok: Any) -> None:
    update = Update((), "error", "the token draw failed: temperature 1e-40 overflows", error_param="temperature")
    with pytest.raises(ApiError) as caught:
        run(tok, SamplingParams(temperature=1e-40), [update])
    assert (caught.value.status, caught.value.type, caught.value.param) == (400, "invalid_request_error", "temperature")


class FailingGeneration:
    """A generation whose pieces end in `error` after `pieces` one-token pieces, or never end when `error` is None."""

    def __init__(self, pieces: int, error: Exception | None) -> None:
        self.count, self.error = pieces, error

    async def pieces(self):
        for token in range(self.count):
            yield Piece([token])
        if self.error is not None:
            raise self.error
        await asyncio.Event().wait()  # a choice still drawing


@pytest.mark.parametrize("error", [RuntimeError("detokenizing failed"), ApiError("bad", param="temperature")])
def test_any_failure_of_one_choice_ends_interleaved_choices(error: Exception) -> None:
    """A stream of several choices ends with the first failure of any one, whatever its kind, rather than waiting
    for a choice that will never end."""

    async def main() -> list[tuple[int, list[int]]]:
        got = []
        with pytest.raises(type(error)):
            async for index, piece in interleaved([FailingGeneration(2, None), FailingGeneration(1, error)]):
                got.append((index, piece.token_ids))
        return got

    got = asyncio.run(asyncio.wait_for(main(), 5))
    assert sorted(got) == [(0, [0]), (0, [1]), (1, [0])]
