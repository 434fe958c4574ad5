"""Tests for server/textout.py: incremental detokenization, stop strings and the reasoning split."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from server.textout import IncrementalDetokenizer, ReasoningSplitter, StopMatcher, prompt_opens_thinking

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "tiny_tokenizer.py"
TEXTS = (
    "The quick brown fox jumps over the lazy dog. def f(x):\n    return x + 1\n",
    "Crème brûlée, naïve café, Ångström, façade, señor, Dvořák.",
    "日本語のテキストと中文文本，还有한국어 텍스트。",
    "Emoji 😀🙂👍🏽 and flags 🇫🇷 mixed with text 🎉! 👨‍👩‍👧",
)


def random_splits(ids: list[int], rng: random.Random) -> list[list[int]]:
    """Cut `ids` into consecutive chunks of 1 to 4 ids (sometimes empty)."""
    chunks, at = [], 0
    while at < len(ids):
        size = rng.choice((0, 1, 1, 1, 2, 3, 4))
        chunks.append(ids[at : at + size])
        at += size
    return chunks


def feed_all(feed: Any, pieces: list[str]) -> list[Any]:
    """Results of calling `feed` on each piece in order."""
    return [feed(piece) for piece in pieces]


def load_script() -> Any:
    """Import scripts/tiny_tokenizer.py by path."""
    spec = importlib.util.spec_from_file_location("tiny_tokenizer", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny byte-level BPE tokenizer (vocab 512), loaded through transformers."""
    out = tmp_path_factory.mktemp("tok")
    load_script().build_tokenizer(out, 512)
    return AutoTokenizer.from_pretrained(out)


@pytest.fixture(scope="module")
def specials(tok: Any) -> dict[str, int]:
    """Ids of the tiny tokenizer's special tokens."""
    return {t: tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>", "<think>", "</think>")}


# IncrementalDetokenizer


@pytest.mark.parametrize("seed", range(40))
def test_random_splits_equal_full_decode(tok: Any, specials: dict[str, int], seed: int) -> None:
    """Any split of the ids, specials sprinkled in, concatenates to the full skip-special decode, with no U+FFFD."""
    rng = random.Random(seed)
    ids = tok.encode(rng.choice(TEXTS) + rng.choice(TEXTS), add_special_tokens=False)
    for _ in range(3):
        ids.insert(rng.randrange(len(ids) + 1), rng.choice(list(specials.values())))
    prompt = tok.encode(rng.choice(TEXTS), add_special_tokens=False) if seed % 2 else None
    detok = IncrementalDetokenizer(tok, prompt)
    pieces = [detok.add(chunk) for chunk in random_splits(ids, rng)]
    expected = tok.decode(ids, skip_special_tokens=True)
    assert "".join(pieces) == detok.text == expected
    assert not any("\ufffd" in piece for piece in pieces)
    assert detok.flush() == ""


@pytest.mark.parametrize("text", TEXTS[1:])
def test_a_character_the_prompt_leaves_unfinished_is_the_outputs_first(tok: Any, text: str) -> None:
    """Cut anywhere, even inside a character, the output's text is the full text after the prompt's whole
    characters: the character its first tokens complete included."""
    ids = tok.encode(text, add_special_tokens=False)
    for cut in range(1, len(ids)):
        detok = IncrementalDetokenizer(tok, ids[:cut])
        whole = tok.decode(ids[:cut]).rstrip("\ufffd")
        assert detok.add(ids[cut:]) + detok.flush() == text[len(whole) :], cut


EOS_TEXT = "<|endoftext|>"


def byte_units() -> dict[int, str]:
    """GPT-2's byte-to-unicode table (byte-level BPE spells each byte as one of these characters)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, extra = list(kept), 0
    for b in range(256):
        if b not in kept:
            kept.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(kept, chars, strict=True)}


UNITS = byte_units()


@pytest.fixture(scope="module")
def byte_tok() -> Any:
    """A byte-level BPE tokenizer: one token per byte, one merged token " " + 0xE4 (a space and the first byte of
    a CJK character, as real byte-level vocabularies hold), and a special EOS_TEXT."""
    vocab = {UNITS[b]: b for b in range(256)}
    space, lead = UNITS[0x20], UNITS[0xE4]
    vocab[space + lead] = 256
    vocab[EOS_TEXT] = 257
    core = Tokenizer(models.BPE(vocab=vocab, merges=[(space, lead)]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token=EOS_TEXT)


def byte_id(b: int) -> int:
    return b  # the fixture's vocabulary gives byte b the id b


def test_a_prompt_token_with_text_and_the_start_of_a_character_keeps_that_character(byte_tok):
    """A prompt ending in a token that holds a space and the first byte of 你: the output's text holds the 你 its
    first tokens complete (its text is the full text after the prompt's whole characters)."""
    text = "a 你好"
    ids = byte_tok.encode(text, add_special_tokens=False)
    assert byte_tok.decode(ids[1:2]) == " \ufffd"  # the merged token
    detok = IncrementalDetokenizer(byte_tok, ids[:2])
    out = detok.add(ids[2:]) + detok.flush()
    assert out == "你好", out


def test_an_answer_of_only_eos_after_a_prompt_ending_inside_a_character_has_no_text(byte_tok):
    """A token-id prompt ending inside a character, answered by EOS_TEXT alone (skipped): the output's text is empty,
    as the full decode of its tokens and vLLM give it, and as before the change (not a U+FFFD of the prompt's)."""
    prompt = [byte_id(0x61), byte_id(0xE4)]  # "a" and the first byte of 你
    eos = byte_tok.convert_tokens_to_ids(EOS_TEXT)
    detok = IncrementalDetokenizer(byte_tok, prompt)
    out = detok.add([eos]) + detok.flush()
    assert out == byte_tok.decode([eos], skip_special_tokens=True) == "", repr(out)


def test_a_prompt_byte_that_can_begin_no_character_is_not_output(byte_tok):
    """A prompt ending in a lone continuation byte (0x80, which begins no character) is not held for the output:
    the output "hi" reads "hi", not U+FFFD + "hi" (IncrementalDetokenizer._unfinished's own contract)."""
    prompt = [byte_id(0x61), byte_id(0x80)]
    detok = IncrementalDetokenizer(byte_tok, prompt)
    out = detok.add(byte_tok.encode("hi", add_special_tokens=False)) + detok.flush()
    assert out == "hi", repr(out)


def test_emoji_bytes_are_held_until_complete(tok: Any) -> None:
    """An emoji spread over byte tokens comes out whole, once, when its last byte arrives."""
    ids = tok.encode("a😀b", add_special_tokens=False)
    assert len(ids) >= 4  # the emoji takes several tokens in this small vocab
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.add([i]) for i in ids]
    assert pieces[0] == "a" and pieces[-1] == "b"
    assert pieces[1:-1] == [""] * (len(ids) - 3) + ["😀"]


def test_flush_gives_an_unfinished_character(tok: Any) -> None:
    """Generation ending mid-character: add() held it back, flush() gives what the full decode shows."""
    ids = tok.encode("ok 👍", add_special_tokens=False)[:-1]
    detok = IncrementalDetokenizer(tok)
    held = [detok.add([i]) for i in ids]
    assert "\ufffd" not in "".join(held)
    tail = detok.flush()
    assert tail.endswith("\ufffd") and detok.text == tok.decode(ids) and detok.flush() == ""


class CountingTokenizer:
    """Wraps a tokenizer and records the length of every id list it decodes."""

    def __init__(self, inner: Any) -> None:
        """Wrap `inner`."""
        self.inner, self.lengths = inner, []

    def __getattr__(self, name: str) -> Any:
        """Everything else comes from the wrapped tokenizer."""
        return getattr(self.inner, name)

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        """Record the length, then decode."""
        self.lengths.append(len(ids))
        return self.inner.decode(ids, **kwargs)


def test_decode_window_stays_small(tok: Any) -> None:
    """Each call decodes a few ids, however long the prompt and the generation (O(window), not O(sequence))."""
    counting = CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting, tok.encode(TEXTS[0] * 5, add_special_tokens=False))
    ids = tok.encode(TEXTS[3] * 20, add_special_tokens=False)
    for i in ids:
        detok.add([i])
    assert detok.text == tok.decode(ids)
    assert len(ids) > 500 and 0 < max(counting.lengths) <= 8


def test_prompt_context_keeps_leading_space() -> None:
    """A sentencepiece-style decoder drops a text-initial space; the prompt's tail keeps it on the first piece."""
    word_level = Tokenizer(models.WordLevel({"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3}, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.Metaspace()
    word_level.decoder = decoders.Metaspace()
    metaspace = PreTrainedTokenizerFast(tokenizer_object=word_level, unk_token="<unk>")
    with_prompt = IncrementalDetokenizer(metaspace, prompt_ids=[1])
    assert [with_prompt.add([2]), with_prompt.add([3]), with_prompt.add([2])] == [" world", "!", " world"]
    assert IncrementalDetokenizer(metaspace).add([2, 3]) == "world!"


def test_keep_tokens_render_think_tags(tok: Any, specials: dict[str, int]) -> None:
    """keep_tokens renders <think>/</think> as text while other specials are still skipped."""
    ids = [
        specials["<think>"],
        *tok.encode("\nhmm é\n", add_special_tokens=False),
        specials["</think>"],
        *tok.encode("\n\nyes", add_special_tokens=False),
        specials["<|im_end|>"],
    ]
    plain = IncrementalDetokenizer(tok)
    kept = IncrementalDetokenizer(tok, keep_tokens=("<think>", "</think>", "<not-a-token>"))
    assert "".join(plain.add([i]) for i in ids) == "\nhmm é\n\n\nyes"
    assert "".join(kept.add([i]) for i in ids) == "<think>\nhmm é\n</think>\n\nyes"


def test_kept_think_tokens_feed_the_splitter(tok: Any, specials: dict[str, int]) -> None:
    """Detokenizer with kept tags into the splitter, one token at a time, separates reasoning from content."""
    ids = [
        specials["<think>"],
        *tok.encode("\nLet me think.\n", add_special_tokens=False),
        specials["</think>"],
        *tok.encode("\n\nThe answer is 4.", add_special_tokens=False),
    ]
    detok = IncrementalDetokenizer(tok, keep_tokens=("<think>", "</think>"))
    splitter = ReasoningSplitter(thinking_open=False)
    parts = [splitter.feed(detok.add([i])) for i in ids]
    assert "".join(r for r, _ in parts) == "Let me think.\n"
    assert "".join(c for _, c in parts) == "The answer is 4."


# StopMatcher


def run_stops(stops: tuple[str, ...], pieces: list[str]) -> tuple[str, bool]:
    """Feed pieces until stopped; the emitted text (plus the flush when never stopped) and whether it stopped."""
    matcher = StopMatcher(stops)
    out = []
    for piece in pieces:
        text, stopped = matcher.feed(piece)
        out.append(text)
        if stopped:
            return "".join(out), True
    return "".join(out) + matcher.flush(), False


def test_stop_spanning_feeds_is_cut() -> None:
    """A stop string split over several feeds is held, then cut with the text after it."""
    matcher = StopMatcher(("STOP",))
    results = feed_all(matcher.feed, ["abc S", "T", "O", "Px y"])
    assert results == [("abc ", False), ("", False), ("", False), ("", True)]
    assert matcher.feed("more") == ("", True)


def test_false_start_is_released() -> None:
    """Held text that turns out not to be a stop string comes out on the next feed."""
    matcher = StopMatcher(("STOP",))
    assert feed_all(matcher.feed, ["xST", "OQ", "z"]) == [("x", False), ("STOQ", False), ("z", False)]


def test_earliest_of_several_stops_wins() -> None:
    """With several stop strings, the one that starts first cuts the text."""
    assert run_stops(("world", "lo w", "\n"), ["hel", "lo wor", "ld\n"]) == ("hel", True)
    assert run_stops(("bb", "abc"), ["xa", "bc bb"]) == ("x", True)


@pytest.mark.parametrize(
    ("include", "stops", "matched"),
    [(False, ("lo w", "hello"), "hello"), (True, ("hello", "ell"), "ell"), (False, ("he", "hel"), "he")],
)
def test_the_matcher_names_the_stop_string_it_cut_at(include: bool, stops: tuple[str, ...], matched: str) -> None:
    """The stop string that decides the cut: the first to start (to end, with include), the first listed on a tie."""
    matcher = StopMatcher(stops, include=include)
    assert matcher.matched is None and matcher.feed("say hello world")[1]
    assert matcher.matched == matched


def test_stop_at_the_very_start() -> None:
    """A stop string at the start of the output emits nothing."""
    assert run_stops(("</s>",), ["</", "s>after"]) == ("", True)
    assert run_stops(("\n\n",), ["\n\nText"]) == ("", True)


def test_flush_returns_held_text() -> None:
    """Text held as a possible stop start is returned by flush when the generation ends otherwise."""
    matcher = StopMatcher(("END", "ENDING"))
    assert matcher.feed("the EN") == ("the ", False)
    assert matcher.flush() == "EN"
    assert matcher.flush() == ""


@pytest.mark.parametrize("seed", range(20))
def test_random_pieces_match_one_shot_cut(seed: int) -> None:
    """Random piece boundaries give the same result as cutting the whole text at its first stop."""
    rng = random.Random(seed)
    stops = ("<|end|>", "\n\nQ:", "xyz")
    text = "".join(rng.choice(["ab", "<|", "end", "|>", "\n", "Q:", "x", "y", "z", "é"]) for _ in range(30))
    cuts = sorted(rng.sample(range(1, len(text)), 6))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    hits = [i for s in stops if (i := text.find(s)) >= 0]
    expected = (text[: min(hits)], True) if hits else (text, False)
    assert run_stops(stops, pieces) == expected


def test_included_stop_ends_the_text_after_the_first_stop_to_end() -> None:
    """include_stop_str_in_output: the text runs through the stop string that completes first, and no further."""
    matcher = StopMatcher(("STOP",), include=True)
    assert feed_all(matcher.feed, ["abc S", "TO", "Px y"]) == [("abc ", False), ("", False), ("STOP", True)]
    assert StopMatcher(("lo w", "world"), include=True).feed("hello world") == ("hello w", True)
    assert StopMatcher(("abcd", "bc"), include=True).feed("xabcd") == ("xabc", True)


def test_no_stops_passes_through() -> None:
    """Without stop strings (or only empty ones) nothing is held back."""
    assert StopMatcher(("",)).feed("abc") == ("abc", False)


# ReasoningSplitter


def split_all(splitter: ReasoningSplitter, pieces: list[str]) -> tuple[str, str]:
    """Concatenated (reasoning, content) over all pieces plus the flush."""
    parts = [*feed_all(splitter.feed, pieces), splitter.flush()]
    return "".join(r for r, _ in parts), "".join(c for _, c in parts)


def test_thinking_open_splits_at_end_tag() -> None:
    """Prompt ends inside the block: text goes to reasoning until </think>, then to content minus newlines."""
    splitter = ReasoningSplitter(thinking_open=True)
    assert splitter.feed("Let me see.\n") == ("Let me see.\n", "")
    assert splitter.feed("</think>\n\nHello") == ("", "Hello")
    assert splitter.feed(" world\n") == ("", " world\n")


def test_generated_start_tag_opens_block() -> None:
    """Not open: a generated <think> after whitespace opens the block; the tag and newlines are dropped."""
    pieces = ["\n", "<think>\nplan\n</think>\n\nanswer"]
    assert split_all(ReasoningSplitter(thinking_open=False), pieces) == ("plan\n", "answer")


def test_no_tags_is_all_content() -> None:
    """Without tags and not open, everything is content, leading whitespace included."""
    assert split_all(ReasoningSplitter(thinking_open=False), ["  Hi", " there </think>", "\n"]) == (
        "",
        "  Hi there </think>\n",
    )
    assert split_all(ReasoningSplitter(thinking_open=False), ["<thin", "g>"]) == ("", "<thing>")


def test_tags_split_across_feeds() -> None:
    """Tags cut into single characters are still recognised, and nothing of them leaks out."""
    text = " <think>\nstep one</think>\n\nfinal </think> text"
    splitter = ReasoningSplitter(thinking_open=False)
    parts = feed_all(splitter.feed, list(text))
    assert all("<" not in r and "<" not in c for r, c in parts[: text.index("final")])
    assert split_all(ReasoningSplitter(thinking_open=False), list(text)) == ("step one", "final </think> text")


def test_only_one_or_two_newlines_dropped_after_end_tag() -> None:
    """One or two newlines after </think> are dropped, a third is content; a lone one held at the end is dropped."""
    assert split_all(ReasoningSplitter(True), ["a</think>", "\n", "\n", "\nb"]) == ("a", "\nb")
    assert split_all(ReasoningSplitter(True), ["a</think>\nb"]) == ("a", "b")
    assert split_all(ReasoningSplitter(True), ["a</think>", "\n"]) == ("a", "")


def test_flush_returns_held_partial_tags() -> None:
    """Held text that never became a tag is flushed to the side it was on."""
    open_splitter = ReasoningSplitter(thinking_open=True)
    assert open_splitter.feed("x </thi") == ("x ", "")
    assert open_splitter.flush() == ("</thi", "")
    closed = ReasoningSplitter(thinking_open=False)
    assert closed.feed(" <thi") == ("", "")
    assert closed.flush() == ("", " <thi")


CODER = ("<tool_call>", "<function=")


def test_a_coder_call_ends_an_open_think_block_split_anywhere() -> None:
    """With `call`, a call block opened in reasoning begins the content, tag and all, fed whole or a character at a
    time; a call tag not followed by a function stays reasoning, as does a call tag without `call`."""
    text = "Check it <tool_call> no.\n<tool_call>\n<function=f>\n</function>\n</tool_call>"
    want = ("Check it <tool_call> no.\n", "<tool_call>\n<function=f>\n</function>\n</tool_call>")
    assert split_all(ReasoningSplitter(True, call=CODER), [text]) == want
    assert split_all(ReasoningSplitter(True, call=CODER), list(text)) == want
    assert split_all(ReasoningSplitter(True), list(text)) == (text, "")
    assert split_all(ReasoningSplitter(True, call=CODER), ["a <tool_call>\n", "<func"]) == ("a <tool_call>\n<func", "")


def test_a_start_tag_written_inside_an_opened_block_is_dropped() -> None:
    """The prompt opened the block and the answer opens it again: the second tag is not reasoning text."""
    assert split_all(ReasoningSplitter(True), list("\n<think>\nwhy</think>\n\nok")) == ("why", "ok")
    assert split_all(ReasoningSplitter(True), ["\n", "why <think>", "</think>ok"]) == ("\nwhy <think>", "ok")


def test_custom_tags() -> None:
    """Other tag strings work the same way."""
    assert split_all(ReasoningSplitter(False, "[R]", "[/R]"), ["[R", "]why[/", "R]\nok"]) == ("why", "ok")


def test_prompt_opens_thinking(tok: Any) -> None:
    """The rendered chat template opens a block unless thinking is disabled."""
    chat = [{"role": "user", "content": "Hi"}]
    opened = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    closed = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert prompt_opens_thinking(opened) and not prompt_opens_thinking(closed)
    assert not prompt_opens_thinking("no tags") and not prompt_opens_thinking(closed + "<thinkish")
    assert prompt_opens_thinking("<think>a</think><think>", "<think>", "</think>")


@pytest.mark.parametrize("chunked", [False, True])
def test_a_replacement_character_holding_output_bytes_is_the_outputs(byte_tok, chunked):
    """A prompt ending in E4 (a character's first byte) and an output BD 'a' (BD continues it, 'a' cuts it short):
    the whole text's U+FFFD holds the output's byte BD, so the output's text is U+FFFD + 'a' (not 'a')."""
    prompt = [0x61, 0xE4]  # byte ids: "a", first byte of 你
    output = [0xBD, 0x61]
    whole = bytes(prompt + output).decode("utf-8", "replace")
    assert whole == "a\ufffda" and bytes(prompt).decode("utf-8", "replace") == "a\ufffd"
    assert bytes([0xE4, 0xBD]).decode("utf-8", "replace") == "\ufffd"  # one character of prompt and output bytes
    detok = IncrementalDetokenizer(byte_tok, prompt)
    pieces = [detok.add([t]) for t in output] if chunked else [detok.add(output)]
    out = "".join(pieces) + detok.flush()
    assert out == "\ufffda", repr(out)


def test_an_output_byte_continuing_the_prompts_last_character_is_not_lost_at_the_end(byte_tok):
    """Prompt "a" + E4, output BD alone then the end: the unfinished character of prompt and output bytes shows as
    U+FFFD in the output (flush's contract), not as nothing."""
    detok = IncrementalDetokenizer(byte_tok, [0x61, 0xE4])
    out = detok.add([0xBD]) + detok.flush()
    assert out == "\ufffd", repr(out)
