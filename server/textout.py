"""Per-request text output: incremental detokenization, stop strings and the reasoning/content split."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any

# Prompt tokens decoded ahead of the first generated ones, so tokenizers that shape a piece by its left
# neighbour (sentencepiece's leading space) decode the first generated piece as they would in the full text.
PROMPT_CONTEXT = 4
PROMPT_CONTEXT_MAX = 24  # more, while the context would begin inside a character (vLLM's bound)
REPLACEMENT = "\ufffd"


def partial_len(text: str, patterns: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `patterns`."""
    for n in range(min(len(text), max((len(p) for p in patterns), default=1) - 1), 0, -1):
        tail = text[-n:]
        if any(p.startswith(tail) for p in patterns):
            return n
    return 0


class IncrementalDetokenizer:
    """Turn token ids, given a few at a time, into text deltas that never end inside a UTF-8 character."""

    __slots__ = ("_ids", "_pieces", "_read", "_skip", "_tokenizer")

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: Iterable[int] | None = None,
        keep_tokens: tuple[str, ...] = (),
        skip_special: bool = True,
    ) -> None:
        """Skip special tokens (where `skip_special`) except `keep_tokens` (rendered as their text); `prompt_ids` give
        left context."""
        keep = {
            tid
            for token in keep_tokens
            if (tid := tokenizer.convert_tokens_to_ids(token)) is not None
            and tokenizer.convert_ids_to_tokens(tid) == token
        }
        special = {tid for tid, added in tokenizer.added_tokens_decoder.items() if added.special}
        self._tokenizer = tokenizer
        self._skip = (special | set(tokenizer.all_special_ids)) - keep if skip_special else set()
        # The window: ids[:read] were already turned into text and only give context; ids[read:] are pending. The
        # prompt's context begins at a character's start (grown back while it would not).
        ids = [i for i in prompt_ids or () if i not in self._skip]
        size = min(PROMPT_CONTEXT, len(ids))
        while size < min(PROMPT_CONTEXT_MAX, len(ids)) and tokenizer.decode(ids[-size:]).startswith(REPLACEMENT):
            size += 1
        self._ids = ids[len(ids) - size :]
        self._read = len(self._ids)
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        """All text handed out so far."""
        return "".join(self._pieces)

    def add(self, token_ids: Iterable[int]) -> str:
        """Text of the new tokens; empty while the decoded window ends in an unfinished character."""
        self._ids.extend(i for i in token_ids if i not in self._skip)
        return self._advance(finished=False)

    def flush(self) -> str:
        """Text still held back (an unfinished character shows as U+FFFD), for when the generation has ended."""
        return self._advance(finished=True)

    def _advance(self, finished: bool) -> str:
        """Decode context plus pending ids, hand out what follows the context's text, and slide the window."""
        if self._read == len(self._ids):
            return ""
        full = self._tokenizer.decode(self._ids, skip_special_tokens=False)
        if full.endswith(REPLACEMENT) and not finished:
            return ""
        read = self._tokenizer.decode(self._ids[: self._read], skip_special_tokens=False)
        start = len(read)
        ending = start - len(read.rstrip(REPLACEMENT))
        if ending:  # the context's text ends in U+FFFD: a prompt ending inside a character, or in bytes that begin none
            new = self._tokenizer.decode(self._ids[self._read :], skip_special_tokens=False)
            leading = len(new) - len(new.lstrip(REPLACEMENT))
            whole = full[start - ending :]
            run = len(whole) - len(whole.lstrip(REPLACEMENT))
            # fewer than both texts' replacement characters: the new bytes complete or continue the context's last
            # character, which is then theirs (as vLLM's detokenizer primed with the prompt gives it)
            start -= run < ending + leading
        delta = full[start:]
        del self._ids[: self._read]
        self._read = len(self._ids)
        self._pieces.append(delta)
        return delta


class StopMatcher:
    """Cut generated text at the first stop string, holding back text that may be the start of one."""

    __slots__ = ("_held", "_include", "_stops", "matched", "stopped")

    def __init__(self, stops: tuple[str, ...], include: bool = False) -> None:
        """Empty stop strings are ignored; `include`: the text ends after the stop string, not before it."""
        self._stops = tuple(s for s in stops if s)
        self._include = include
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string the text was cut at

    @property
    def watching(self) -> bool:
        """Whether there is any stop string to look for."""
        return bool(self._stops)

    def feed(self, text: str, watch: bool = True) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop string was reached); the text ends where the first stop string found
        starts, or with `include` where the first to end ends (of two that cut it at one place, the first listed).
        Only a stop string that ends in the text of a watched feed counts (min_tokens' text is fed unwatched: held
        back as any text that may begin one, so that a stop string it begins still cuts it, as vLLM's)."""
        if self.stopped:
            return "", True
        text, fresh = self._held + text, len(self._held)  # where this feed's text begins
        hits = [
            (i, i + len(stop), stop)
            for stop in self._stops
            if watch and (i := text.find(stop, max(0, fresh - len(stop) + 1))) >= 0
        ]
        if hits:
            start, end, self.matched = min(hits, key=lambda hit: hit[1] if self._include else hit[0])
            self._held, self.stopped = "", True
            return text[: end if self._include else start], True
        cut = len(text) - partial_len(text, self._stops)
        self._held = text[cut:]
        return text[:cut], False

    def flush(self) -> str:
        """The held-back text, for when the generation ends for another reason."""
        held, self._held = self._held, ""
        return held


class _Phase(enum.Enum):
    """Where a ReasoningSplitter is in the generated text."""

    BEFORE = enum.auto()  # nothing but whitespace yet: a start tag may still open a think block
    OPENED = enum.auto()  # the prompt opened the block, and nothing but whitespace came yet: a start tag is dropped
    REASONING = enum.auto()
    CONTENT = enum.auto()


class ReasoningSplitter:
    """Split generated text into reasoning (inside a Qwen-style think block) and content (after it)."""

    __slots__ = ("_call", "_end", "_fed", "_held", "_phase", "_start", "_strip", "call_offset", "called")

    def __init__(
        self, thinking_open: bool, start: str = "<think>", end: str = "</think>", call: tuple[str, str] | None = None
    ) -> None:
        """`thinking_open`: the rendered prompt ends inside a think block (a start tag the model writes again is
        dropped). `call`: (block tag, its body's opening), e.g. ("<tool_call>", "<function"): such a block begins the
        content where a think block is left open, as vLLM's qwen3 reasoning parser takes it."""
        self._start, self._end, self._call = start, end, call
        self._phase = _Phase.OPENED if thinking_open else _Phase.BEFORE
        self._held = ""
        self._strip = 0  # newlines still to drop right after a tag
        self.called = False  # whether a call block ended the reasoning
        self.call_offset = 0  # where that call's tag begins in the text fed
        self._fed = 0  # characters fed so far

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning delta, content delta); tags are dropped, and text that may be part of one is held back."""
        reasoning: list[str] = []
        content: list[str] = []
        self._fed += len(text)
        text, self._held = self._held + text, ""  # ever a suffix of what was fed: text[i] is at _fed - len(text) + i
        while text:
            if self._strip:
                newlines = len(text) - len(text.lstrip("\n"))
                if newlines == len(text) < self._strip:
                    self._held = text
                    break
                text, self._strip = text[min(newlines, self._strip) :], 0
            elif self._phase in (_Phase.BEFORE, _Phase.OPENED):
                body = text.lstrip()
                if body.startswith(self._start):
                    text, self._phase, self._strip = body[len(self._start) :], _Phase.REASONING, 1
                elif self._start.startswith(body):
                    self._held = text
                    break
                else:
                    self._phase = _Phase.REASONING if self._phase is _Phase.OPENED else _Phase.CONTENT
            elif self._phase is _Phase.REASONING:
                at = text.find(self._end)
                call, undecided = self._call_at(text)
                if call >= 0 and (at < 0 or call < at):  # the call stays in the content, tag and all
                    reasoning.append(text[:call])
                    if undecided:
                        self._held = text[call:]
                        break
                    self.call_offset = self._fed - len(text) + call
                    text, self._phase, self.called = text[call:], _Phase.CONTENT, True
                elif at >= 0:
                    reasoning.append(text[:at])
                    text, self._phase, self._strip = text[at + len(self._end) :], _Phase.CONTENT, 2
                else:
                    cut = len(text) - partial_len(text, (self._end, self._call[0]) if self._call else (self._end,))
                    reasoning.append(text[:cut])
                    self._held = text[cut:]
                    break
            else:
                content.append(text)
                break
        return "".join(reasoning), "".join(content)

    @property
    def reasoning(self) -> bool:
        """Whether the text fed so far ends inside the think block (a call or its end tag may still come)."""
        return self._phase in (_Phase.OPENED, _Phase.REASONING)

    def _call_at(self, text: str) -> tuple[int, bool]:
        """Where in reasoning text a call block opens (-1: nowhere), and whether what follows its tag may still turn
        out not to be a call's body (to be held back)."""
        if self._call is None:
            return -1, False
        tag, body = self._call
        at = text.find(tag)
        while at >= 0:
            rest = text[at + len(tag) :].lstrip()
            if rest.startswith(body) or body.startswith(rest):
                return at, not rest.startswith(body)
            at = text.find(tag, at + 1)
        return -1, False

    def flush(self) -> tuple[str, str]:
        """The held-back text as (reasoning, content), for when the generation ends; held newlines are dropped."""
        held, self._held = self._held, ""
        if self._strip:
            return "", ""
        return (held, "") if self.reasoning else ("", held)


def prompt_opens_thinking(prompt_text: str, start: str = "<think>", end: str = "</think>") -> bool:
    """True when the rendered prompt's last start tag comes after its last end tag."""
    return prompt_text.rfind(start) > prompt_text.rfind(end)
