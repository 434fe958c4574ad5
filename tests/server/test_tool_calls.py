"""Tests for server/tool_calls.py: Hermes-style tool call blocks, parsed whole and streamed."""

from __future__ import annotations

import itertools
import json
import random
import re
from collections.abc import Callable

import pytest

from server.tool_calls import ForcedCalls, ToolCall, ToolCallCut, ToolCallStream, new_call_id, parse_tool_calls

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
EMPTY = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
BAD = '<tool_call>\n{"name": "f", "arguments": {"a": }\n</tool_call>'

# (text, content, [(name, arguments JSON)]), worked out by hand from the module's rules.
CASES = [
    ("Just an answer.", "Just an answer.", []),
    ("", "", []),
    (" \n ", " \n ", []),
    ("Let me check.\n" + WEATHER, "Let me check.\n", [("get_weather", '{"city": "Paris"}')]),
    (WEATHER + "\n" + EMPTY + "\n", "", [("get_weather", '{"city": "Paris"}'), ("f", "{}")]),
    ("\n\n" + EMPTY, "", [("f", "{}")]),
    ("A" + EMPTY + "\n\nB" + EMPTY + " ", "A\n\nB", [("f", "{}"), ("f", "{}")]),
    (EMPTY + "\n" + BAD, "\n" + BAD, [("f", "{}")]),
    (BAD + EMPTY, BAD, [("f", "{}")]),
    ("x\n" + BAD, "x\n" + BAD, []),
    ("Hi " + EMPTY + " <tool_call>\n{", "Hi  <tool_call>\n{", [("f", "{}")]),
    ("a < b <tool_ c" + EMPTY + "<tool_cal", "a < b <tool_ c<tool_cal", [("f", "{}")]),
    ("<tool_call><tool_call>{}</tool_call>", "<tool_call><tool_call>{}</tool_call>", []),
    ("stray </tool_call> end" + EMPTY, "stray </tool_call> end", [("f", "{}")]),
    ('<tool_call>{"name": "g", "arguments": {"q": "</tool_"}}</tool_call>', "", [("g", '{"q": "</tool_"}')]),
    ('<tool_call>{"name": "g", "arguments": "{\\"n\\": 1}"}</tool_call>', "", [("g", '{"n": 1}')]),
    ('<tool_call>{"name": "g", "parameters": {"n": 1}}</tool_call>', "", [("g", '{"n": 1}')]),  # Llama's name
    ('<tool_call>{"name": "g", "arguments": {}, "parameters": {"n": 1}}</tool_call>', "", [("g", "{}")]),
    ('<tool_call>{"name": "h"}</tool_call>\n', "", [("h", "{}")]),
    ('<tool_call>{"name": 3, "arguments": {}}</tool_call>', '<tool_call>{"name": 3, "arguments": {}}</tool_call>', []),
]


def counter_ids() -> Callable[[], str]:
    """Deterministic ids: call-0, call-1, ..."""
    count = itertools.count()
    return lambda: f"call-{next(count)}"


def expected_calls(calls: list[tuple[str, str]]) -> list[ToolCall]:
    """The calls counter_ids would give, in order."""
    return [ToolCall(f"call-{i}", name, args) for i, (name, args) in enumerate(calls)]


def stream(pieces: list[str]) -> tuple[str, list[ToolCall]]:
    """All content deltas joined and all calls, feeding `pieces` then flushing."""
    parser = ToolCallStream(make_id=counter_ids())
    content: list[str] = []
    calls: list[ToolCall] = []
    for piece in [*pieces, None]:
        delta, done = parser.feed(piece) if piece is not None else parser.flush()
        content.append(delta)
        calls.extend(done)
    return "".join(content), calls


# Whole text


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_parse_cases(text: str, content: str, calls: list[tuple[str, str]]) -> None:
    assert parse_tool_calls(text, make_id=counter_ids()) == (content, expected_calls(calls))


def test_no_calls_returns_text_unchanged() -> None:
    text = "No tools needed: 2 + 2 = 4.\n"
    assert parse_tool_calls(text) == (text, [])


def test_one_call_with_text_before() -> None:
    content, calls = parse_tool_calls("Let me check.\n" + WEATHER, make_id=lambda: "id-1")
    assert content == "Let me check.\n"
    assert calls == [ToolCall("id-1", "get_weather", '{"city": "Paris"}')]
    assert json.loads(calls[0].arguments) == {"city": "Paris"}


def test_two_calls_only_give_empty_content() -> None:
    content, calls = parse_tool_calls(WEATHER + "\n" + EMPTY, make_id=counter_ids())
    assert content == ""
    assert [(c.id, c.name, c.arguments) for c in calls] == [
        ("call-0", "get_weather", '{"city": "Paris"}'),
        ("call-1", "f", "{}"),
    ]


def test_string_arguments_are_normalized() -> None:
    text = '<tool_call>{"name": "g", "arguments": "{\\"b\\":  [1,2], \\"a\\": null}"}</tool_call>'
    _, (call,) = parse_tool_calls(text)
    assert call.arguments == '{"b": [1, 2], "a": null}'


@pytest.mark.parametrize("arguments", ['"[1, 2]"', '"not json"', "[1]", "null", "5"])
def test_arguments_not_an_object_keep_the_block(arguments: str) -> None:
    text = f'<tool_call>{{"name": "g", "arguments": {arguments}}}</tool_call>'
    assert parse_tool_calls(text) == (text, [])


def test_missing_arguments_give_empty_object() -> None:
    _, (call,) = parse_tool_calls('<tool_call>{"name": "now"}</tool_call>')
    assert (call.name, call.arguments) == ("now", "{}")


def test_bad_json_block_kept_verbatim_in_place() -> None:
    text = "Before " + BAD + " after" + EMPTY
    content, calls = parse_tool_calls(text, make_id=counter_ids())
    assert content == "Before " + BAD + " after"
    assert calls == [ToolCall("call-0", "f", "{}")]


def test_an_unclosed_last_block_is_content_unless_its_text_parses() -> None:
    """As vLLM's Hermes parser takes a block whose end tag a stop string cut: a call where its text parses."""
    cut = EMPTY + '\n<tool_call>\n{"name": "g", "arguments": {"x": 1'
    content, calls = parse_tool_calls(cut, make_id=counter_ids())
    assert content == '\n<tool_call>\n{"name": "g", "arguments": {"x": 1' and [c.name for c in calls] == ["f"]
    content, calls = parse_tool_calls(cut + "}}\n", make_id=counter_ids())
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("f", "{}"), ("g", '{"x": 1}')]
    assert stream([cut + "}}", "\n"]) == (content, calls)


@pytest.mark.parametrize("escape", ['"\\ud83d"', '"\\udc00 x"'])
def test_a_lone_surrogate_escape_is_no_call(escape: str) -> None:
    """A call whose name or arguments hold half a surrogate pair could not be written as UTF-8: it stays content."""
    for block in (f'<tool_call>{{"name": "f", "arguments": {{"c": {escape}}}}}</tool_call>',
                  f'<tool_call>{{"name": {escape}}}</tool_call>'):  # fmt: skip
        assert parse_tool_calls(block) == (block, [])
        assert stream([block]) == (block, [])


def test_non_ascii_arguments_kept() -> None:
    _, (call,) = parse_tool_calls('<tool_call>{"name": "t", "arguments": {"city": "Zürich 東京 😀"}}</tool_call>')
    assert call.arguments == '{"city": "Zürich 東京 😀"}'


@pytest.mark.parametrize("name", ["3", '""', "null", '["f"]'])
def test_name_not_a_nonempty_string_kept_as_content(name: str) -> None:
    text = f'<tool_call>{{"name": {name}, "arguments": {{}}}}</tool_call>'
    assert parse_tool_calls(text) == (text, [])


def test_nan_arguments_kept_as_content() -> None:
    text = '<tool_call>{"name": "g", "arguments": {"x": NaN}}</tool_call>'
    assert parse_tool_calls(text) == (text, [])


# Streaming


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_stream_every_two_piece_split(text: str, content: str, calls: list[tuple[str, str]]) -> None:
    for cut in range(len(text) + 1):
        assert stream([text[:cut], text[cut:]]) == (content, expected_calls(calls)), cut


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_stream_one_character_pieces(text: str, content: str, calls: list[tuple[str, str]]) -> None:
    assert stream(list(text)) == (content, expected_calls(calls))


def test_stream_equals_whole_text_on_random_texts() -> None:
    rng = random.Random(7)
    parts = [WEATHER, EMPTY, BAD, "<tool_call>", "</tool_call>", "<tool_", "</tool", "\n", " ", "text", "{", "é"]
    for _ in range(400):
        text = "".join(rng.choices(parts, k=rng.randint(0, 7)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 5))))
        pieces = [text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])]
        assert stream(pieces) == parse_tool_calls(text, make_id=counter_ids()), pieces


def test_stream_sends_content_at_once_and_holds_only_a_tag_start() -> None:
    parser = ToolCallStream(make_id=counter_ids())
    assert parser.feed("Let me check") == ("Let me check", [])
    assert parser.feed(". <tool_") == (". ", [])
    assert parser.feed("x") == ("<tool_x", [])
    assert parser.feed(" <tool_call>") == (" ", [])
    assert parser.feed('{"name": "f"}</tool_ca') == ("", [])
    assert parser.feed("ll>") == ("", [ToolCall("call-0", "f", "{}")])
    assert parser.flush() == ("", [])


def test_stream_holds_whitespace_after_a_call_until_text_follows() -> None:
    parser = ToolCallStream(make_id=counter_ids())
    assert parser.feed(EMPTY + "\n") == ("", [ToolCall("call-0", "f", "{}")])
    assert parser.feed("\n") == ("", [])
    assert parser.feed("Done") == ("\n\nDone", [])
    assert parser.feed(" <tool_call") == (" ", [])
    assert parser.flush() == ("<tool_call", [])


def test_stream_drops_whitespace_before_a_call_and_at_the_end() -> None:
    parser = ToolCallStream(make_id=counter_ids())
    assert parser.feed("\n ") == ("", [])
    assert parser.feed(EMPTY) == ("", [ToolCall("call-0", "f", "{}")])
    assert parser.feed("\n") == ("", [])
    assert parser.flush() == ("", [])


def test_stream_failed_block_releases_held_whitespace() -> None:
    parser = ToolCallStream(make_id=counter_ids())
    assert parser.feed(EMPTY + "\n") == ("", [ToolCall("call-0", "f", "{}")])
    assert parser.feed(BAD[:-3]) == ("", [])
    assert parser.feed(BAD[-3:]) == ("\n" + BAD, [])


def test_stream_unclosed_block_released_at_flush() -> None:
    parser = ToolCallStream(make_id=counter_ids())
    assert parser.feed('ok <tool_call>{"name": "f"') == ("ok ", [])
    assert parser.flush() == ('<tool_call>{"name": "f"', [])
    parser = ToolCallStream(make_id=counter_ids())
    assert parser.feed('ok <tool_call>{"name": "f"}') == ("ok ", [])
    assert parser.flush() == ("", [ToolCall("call-0", "f", "{}")])


# ToolCall and ids


def test_to_openai_shape() -> None:
    call = ToolCall("chatcmpl-tool-abc", "get_weather", '{"city": "Paris"}')
    expected = {
        "id": "chatcmpl-tool-abc",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    assert call.to_openai() == expected
    streamed = call.to_openai(index=2)
    assert streamed == {"index": 2, **expected}
    assert next(iter(streamed)) == "index"


def test_new_call_id_format() -> None:
    ids = {new_call_id() for _ in range(20)}
    assert len(ids) == 20
    assert all(re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", i) for i in ids)


def test_default_ids_are_new_call_ids() -> None:
    _, (a, b) = parse_tool_calls(EMPTY + EMPTY)
    assert a.id != b.id and a.id.startswith("chatcmpl-tool-") and len(a.id) == len("chatcmpl-tool-") + 32


@pytest.mark.parametrize("parallel", [True, False])
def test_a_cut_hands_out_each_call_once_and_only_the_first_without_parallel_calls(parallel: bool) -> None:
    text = "Hi." + EMPTY + EMPTY + '<tool_call>{"name": "g"}'  # the last block's end tag cut off
    cut = ToolCallCut(parallel, make_id=counter_ids())
    pieces = [cut.take(text[at : at + 7], at + 7 >= len(text)) for at in range(0, len(text), 7)]
    content = "".join(piece for piece, _ in pieces)
    calls = [call for _, made in pieces for call in made]
    assert content == "Hi."
    assert [call.name for call in calls] == (["f", "f", "g"] if parallel else ["f"]) and cut.sent == len(calls)


def numbered() -> Callable[[], str]:
    """Call ids call_0, call_1, ... in order."""
    count = iter(range(100))
    return lambda: f"call_{next(count)}"


@pytest.mark.parametrize("pieces", [['{"city": "Paris"}'], ['{"ci', 'ty": ', '"Paris"}']])
def test_a_named_forced_call_holds_the_content_back_and_gives_it_as_the_arguments(pieces):
    forced = ForcedCalls("get_weather", numbered())
    taken = [forced.take(piece, index == len(pieces) - 1) for index, piece in enumerate(pieces)]
    assert taken[:-1] == [("", [])] * (len(pieces) - 1)
    assert taken[-1] == ("", [ToolCall("call_0", "get_weather", '{"city": "Paris"}')]) and forced.sent == 1


def test_required_forced_calls_come_from_the_list_of_names_and_parameters():
    text = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {"é": [true]}}]'
    content, calls = ForcedCalls(None, numbered()).take(text, last=True)
    assert content == "" and calls == [ToolCall("call_0", "a", '{"x": 1}'), ToolCall("call_1", "b", '{"é": [true]}')]


@pytest.mark.parametrize(
    ("text", "content"),
    [
        ('{"name": "a", "parameters": {}}', '{"name": "a", "parameters": {}}'),  # not a list
        ('[{"name": "a"}]', '{"name": "a"}'),  # no parameters
        ('[{"name": 3, "parameters": {}}]', '{"name": 3, "parameters": {}}'),
        ('[{"name": "a", "parameters": {"x": "}"', '{"name": "a", "parameters": {"x": "}"'),  # cut by its length
    ],
)
def test_required_text_that_is_not_a_call_stays_content(text, content):
    forced = ForcedCalls(None)
    assert forced.take(text, last=True) == (content, []) and forced.sent == 0


def test_a_named_call_cut_by_its_length_gives_the_arguments_written_so_far():
    """As vLLM's: the named call carries its text whatever it holds; finish_reason "length" tells it was cut."""
    forced = ForcedCalls("f", numbered())
    assert forced.take('{"city": "Par', last=True) == ("", [ToolCall("call_0", "f", '{"city": "Par')])
    assert forced.finish("length") == "length"


TWO = '[{"name": "a", "parameters": {"x": "}, {"}}, {"name": "b", "parameters": {"y": [1, "]"]}}]'


@pytest.mark.parametrize("seed", range(5))
def test_required_calls_come_as_each_item_closes_whatever_the_pieces(seed):
    """Each call is handed out in the piece that closes its item, the same calls as the whole text gives."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(TWO)), 6))
    pieces = [TWO[a:b] for a, b in zip([0, *cuts], [*cuts, len(TWO)], strict=True)]
    forced = ForcedCalls(None, numbered())
    taken = [forced.take(piece, index == len(pieces) - 1) for index, piece in enumerate(pieces)]
    whole = ForcedCalls(None, numbered()).take(TWO, last=True)
    assert ("".join(content for content, _ in taken), [call for _, calls in taken for call in calls]) == whole
    ends = [sum(map(len, pieces[: index + 1])) for index in range(len(pieces))]  # text so far after each piece
    closing = next(index for index, end in enumerate(ends) if end >= TWO.index("}}") + 2)  # closes the first item
    assert [call.name for _, calls in taken[: closing + 1] for call in calls][:1] == ["a"]
    assert not any(calls for _, calls in taken[:closing])


@pytest.mark.parametrize("pieces", [['{"city": "Paris"}'], ['{"ci', "", 'ty": ', '"Paris"}', ""]])
def test_a_named_call_streams_its_arguments_as_they_come(pieces):
    """The first delta opens the call (index 0, id, type, name) with the first text; the others carry more of
    the arguments; joined they are the arguments the whole answer gives."""
    forced = ForcedCalls("get_weather", numbered())
    deltas = [forced.deltas(piece, index == len(pieces) - 1) for index, piece in enumerate(pieces)]
    entries = [entry for content, calls in deltas for entry in calls]
    assert all(content == "" for content, _ in deltas)
    assert entries[0] == {"index": 0, "id": "call_0", "type": "function",
                          "function": {"name": "get_weather", "arguments": pieces[0]}}  # fmt: skip
    assert all(
        entry == {"index": 0, "function": {"arguments": entry["function"]["arguments"]}} for entry in entries[1:]
    )
    assert "".join(entry["function"]["arguments"] for entry in entries) == '{"city": "Paris"}'
    assert len(entries) == len([piece for piece in pieces if piece]) and forced.sent == 1


def test_a_named_call_that_ends_before_any_text_still_opens():
    forced = ForcedCalls("f", numbered())
    assert forced.deltas("", last=True) == ("", [ToolCall("call_0", "f", "").to_openai(0)])


@pytest.mark.parametrize(
    ("named", "text", "reason", "finish"),
    [
        (None, '[{"name": "a", "parameters": {}}]', "stop", "tool_calls"),
        (None, '[{"name": "a", "parameters": {}}]', "length", "length"),  # it ended at its length: said so
        ("a", "{}", "stop", "stop"),  # a named choice's, as OpenAI's
        (None, "[", "length", "length"),
    ],
)
def test_a_forced_choices_finish_reason_is_vllms(named, text, reason, finish):
    forced = ForcedCalls(named)
    forced.take(text, last=True)
    assert forced.finish(reason) == finish


@pytest.mark.parametrize(
    "text",
    ['"a[1]"', 'so [{"name": "a", "parameters": {"x": "]"}}, 3] then', '[{"name": "a", "parameters": {"x": 1}}, {"na'],
)
def test_required_content_keeps_its_order_whatever_the_pieces(text):
    """Text outside the list and items that are no calls come out in the order written, split or whole."""
    whole = ForcedCalls(None, numbered()).take(text, last=True)
    for seed in range(20):
        cuts = sorted(random.Random(seed).sample(range(1, len(text)), 3))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        forced = ForcedCalls(None, numbered())
        taken = [forced.take(piece, index == len(pieces) - 1) for index, piece in enumerate(pieces)]
        assert ("".join(content for content, _ in taken), [call for _, calls in taken for call in calls]) == whole
