"""One request's trip through the engine seen from the HTTP side: tokens in, text pieces out, stop strings."""

from __future__ import annotations

import asyncio
import bisect
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from rankwire.header import DrawSpec
from server.bad_words import BadWords
from server.engine import PromptLogprob, Request, TokenLogprob, Update
from server.handle import EngineHandle
from server.protocol import ApiError, SamplingParams, fresh_seed
from server.textout import IncrementalDetokenizer, ReasoningSplitter, StopMatcher
from server.tokenizer import single_token_id

THINK_TAGS = ("<think>", "</think>")


@dataclass(frozen=True, slots=True)
class StreamEnd:
    """How a streamed answer ended, and its token counts (the prompt's, those resumed of them, the output's)."""

    finish_reason: str
    stop_reason: int | str | None
    input_tokens: int
    output_tokens: int
    cached_tokens: int
    reasoning_tokens: int = 0


@dataclass(slots=True)
class Piece:
    """What one engine update adds to a response."""

    token_ids: list[int]
    content: str = ""
    reasoning: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or stop_token_ids id that ended it; None for EOS
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token, where the request asked for them
    prompt_logprobs: tuple[PromptLogprob, ...] = ()  # with the first piece, where the request asked for them
    reasoning_tokens: int = 0  # of its tokens, those of the think block (its end tag included)


@dataclass(slots=True)
class Outcome:
    """Everything a finished request produced."""

    token_ids: list[int] = field(default_factory=list)
    content: str = ""
    reasoning: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)  # each prompt token's after the first
    cached_tokens: int = 0
    reasoning_tokens: int = 0  # the think block's tokens, its end tag included


class Generation:
    """Submits one request and turns the engine's updates into text pieces (reasoning split, stop strings cut)."""

    def __init__(
        self,
        engine: EngineHandle,
        tokenizer: Any | None,
        prompt_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        eos_ids: tuple[int, ...],
        thinking_open: bool | None,
        keep_at: tuple[int, ...] = (),
        choice: int = 0,
        bad_words: BadWords = (),
        call_opening: tuple[str, str] | None = None,
    ) -> None:
        """`choice`: which of a request's choices this is; choice i draws with the request's seed + i (wrapped to
        the signed 64-bit range), or a fresh seed where the request has none. `bad_words`: the token sequences of
        the request's bad words. `call_opening`: (block tag, body opening) of a tool call that ends a think block
        left open (`ReasoningSplitter`'s `call`)."""
        self.engine, self.prompt_ids = engine, prompt_ids
        self.request_id = uuid.uuid4().hex
        self.seed = fresh_seed() if params.seed is None else (params.seed + choice + 2**63) % 2**64 - 2**63
        self.queue: asyncio.Queue[Update] = asyncio.Queue()
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(eos_ids))
        draw = DrawSpec(
            params.temperature,
            params.top_k,
            params.top_p,
            params.min_p,
            self.seed,
            params.logit_bias,
            params.logprobs,
            # min_tokens holds back every stop id, EOS too where ignore_eos lets it through later (as vLLM's does)
            tuple(sorted(set(stop_ids) | set(eos_ids))) if params.min_tokens else (),
            len(prompt_ids) + params.min_tokens,  # the position of the first token that may stop it
            params.repetition_penalty,
            params.frequency_penalty,
            params.presence_penalty,
            len(prompt_ids),
            params.allowed_token_ids,
        )
        self.request = Request(
            self.request_id,
            prompt_ids,
            max_tokens,
            draw,
            stop_ids,
            sink=self.queue.put_nowait,  # runs on the event loop: every EngineHandle delivers there
            draft=params.draft,
            keep_at=keep_at,
            cache_salt=params.cache_salt,
            priority=params.priority,
            prompt_logprobs=params.prompt_logprobs,
            guide=params.guide,
            bad_words=bad_words,
        )
        keep = THINK_TAGS if thinking_open is not None else ()
        self.detok = (
            IncrementalDetokenizer(tokenizer, prompt_ids, keep, params.skip_special_tokens) if tokenizer else None
        )
        self.stops = StopMatcher(params.stop, include=params.include_stop_str_in_output)
        self.speak_stop_token = params.include_stop_str_in_output
        # the request's own stop tokens, reported as its stop_reason; an EOS it also lists stays EOS (null), as vLLM's
        self.stop_token_ids = frozenset(params.stop_token_ids) - (frozenset() if params.ignore_eos else set(eos_ids))
        self.splitter = ReasoningSplitter(thinking_open, call=call_opening) if thinking_open is not None else None
        # the think block's end, while the output is inside one (counted as reasoning tokens up to it)
        self.thinking_until = single_token_id(tokenizer, THINK_TAGS[1]) if thinking_open and tokenizer else None
        self.counted = 0  # the think block's tokens counted so far
        # while a call may end the block (the splitter says where its tag begins in the text), the output's text
        # length after each token, by which the count is cut back to the tokens before the tag
        self.call_may_end = bool(call_opening) and self.thinking_until is not None
        self.token_ends: list[int] = []
        self.unwatched = params.min_tokens  # tokens still to come before a stop string may end the output
        self.done = False

    def submit(self) -> None:
        self.engine.submit(self.request)

    def abort(self) -> None:
        """Stop the engine's work on this request (the client left)."""
        if not self.done:
            self.engine.abort(self.request_id)

    async def pieces(self) -> AsyncIterator[Piece]:
        """Text pieces until the request finishes; the last piece carries the finish reason."""
        while not self.done:
            update = await self.queue.get()
            if update.error is not None:
                self.done = True
                if update.error_param is not None:  # the request's own field made it fail: a bad request
                    raise ApiError(update.error, param=update.error_param)
                raise ApiError(update.error, status=503 if update.refused else 500, type="server_error")
            piece = self._piece(update)
            if piece.finish_reason is not None:
                self.done = True
            yield piece

    async def collect(self) -> Outcome:
        """Run to the end and gather everything."""
        outcome = Outcome()
        async for piece in self.pieces():
            outcome.token_ids += piece.token_ids
            outcome.logprobs += piece.logprobs
            outcome.prompt_logprobs += piece.prompt_logprobs
            outcome.content += piece.content
            outcome.reasoning += piece.reasoning
            outcome.reasoning_tokens += piece.reasoning_tokens
            outcome.finish_reason, outcome.stop_reason = piece.finish_reason, piece.stop_reason
        outcome.cached_tokens = self.request.cached
        return outcome

    def _reasoning_tokens(self, tokens: list[int]) -> int:
        """How many of a piece's tokens are the think block's (its end tag included); the block ends with them
        where the end tag is among them."""
        if self.thinking_until is None:
            return 0
        for at, token in enumerate(tokens):
            if token == self.thinking_until:
                self.thinking_until = None
                self.counted += at + 1
                return at + 1
        self.counted += len(tokens)
        return len(tokens)

    def _call_ended_thinking(self, piece: Piece) -> None:
        """Once the think block is over: where a call block ended it, take back the tokens counted from the one
        whose text reaches into the call's tag (the count of this piece may go below zero: the request's sum is what
        is reported); by text, so the same however the tag is spelled in tokens and the tokens came grouped. Either
        way the tokens' text is no longer taken one at a time for it."""
        if not self.call_may_end or self.splitter.reasoning:
            return
        if self.splitter.called:
            before = bisect.bisect_right(self.token_ends, self.splitter.call_offset)
            piece.reasoning_tokens -= self.counted - before
            self.counted, self.thinking_until = before, None
        self.call_may_end, self.token_ends = False, []  # the block is over: no call can end it now

    def _piece(self, update: Update) -> Piece:
        """The update's tokens taken one at a time, as an undrafted request's would come: a stop string ends the
        piece at the token that completes it, so drafts accepted after that token are never part of the output."""
        tokens, finish = list(update.token_ids), update.finish_reason
        # a stop token (from stop_token_ids, or EOS) is kept among the ids but its text is not, as vLLM does
        silent = finish == "stop" and bool(tokens) and tokens[-1] in self.request.stop_ids and not self.speak_stop_token
        spoken = tokens[:-1] if silent else tokens
        if self.stops.watching or self.call_may_end:  # a token at a time: the output may end at the token that
            # completes a stop string; a call's tag is placed among the tokens by their text
            texts = [self.detok.add((token,)) if self.detok else "" for token in spoken] + ([""] if silent else [])
        else:  # nothing can end it early: the update's text at once
            texts = [self.detok.add(spoken) if self.detok else ""]
        if finish is not None and self.detok:  # what the detokenizer held back belongs to the last token
            flushed = self.detok.flush()
            texts = [*texts[:-1], texts[-1] + flushed] if texts else [flushed]
        emit, stop_reason = "", None
        for at, text in enumerate(texts):
            delta, stopped = self.stops.feed(text, watch=at >= self.unwatched)  # no stop ends min_tokens' own text
            emit += delta
            if stopped:
                if finish is None:  # the engine is still drawing for it
                    self.engine.abort(self.request_id, "stop")
                tokens, finish, stop_reason = tokens[: at + 1], "stop", self.stops.matched
                break
        else:
            if finish is not None:
                emit += self.stops.flush()
            if finish == "stop" and tokens and tokens[-1] in self.stop_token_ids:
                stop_reason = tokens[-1]
        self.unwatched = max(self.unwatched - len(update.token_ids), 0)
        if self.call_may_end:
            for text in texts[: len(tokens)]:
                self.token_ends.append((self.token_ends[-1] if self.token_ends else 0) + len(text))
        piece = Piece(
            tokens, finish_reason=finish, stop_reason=stop_reason, logprobs=update.logprobs[: len(tokens)],
            prompt_logprobs=update.prompt_logprobs, reasoning_tokens=self._reasoning_tokens(tokens),
        )  # fmt: skip
        if self.splitter is None:
            piece.content = emit
            return piece
        piece.reasoning, piece.content = self.splitter.feed(emit)
        if finish is not None:
            reasoning, content = self.splitter.flush()
            piece.reasoning += reasoning
            piece.content += content
        self._call_ended_thinking(piece)
        return piece


async def interleaved(generations: list[Generation]) -> AsyncIterator[tuple[int, Piece]]:
    """Each generation's pieces as they come, with its index among `generations`; the first error (of any kind) is
    raised here and ends them all."""
    if len(generations) == 1:
        async for piece in generations[0].pieces():
            yield 0, piece
        return
    queue: asyncio.Queue[tuple[int, Piece | Exception | None]] = asyncio.Queue()

    async def pump(index: int, generation: Generation) -> None:
        try:
            async for piece in generation.pieces():
                queue.put_nowait((index, piece))
        except Exception as exc:  # the consumer raises it, so a stream never waits on a choice that has failed
            queue.put_nowait((index, exc))
        else:
            queue.put_nowait((index, None))  # this generation is done

    pumps = [asyncio.ensure_future(pump(index, generation)) for index, generation in enumerate(generations)]
    try:
        running = len(generations)
        while running:
            index, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item is None:
                running -= 1
            else:
                yield index, item
    finally:
        for task in pumps:
            task.cancel()
