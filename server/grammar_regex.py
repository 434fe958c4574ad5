"""Regular expressions for guided decoding (`guided_regex`, a schema's `pattern`, EBNF's terminals) and fixed choices:
the supported subset parsed into trees, laid into a grammar's network (through `PatternProduct` where lengths or
lookaheads need a product of automata)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial

from server.grammar import (
    ASCII,
    DIGITS,
    MAX_NODES,
    MAX_REPEAT,
    STRING_ASCII,
    Grammar,
    GrammarError,
    Network,
    bits,
    members,
    utf8_char,
    wide_chars,
)
from server.grammar_utf8 import FIRST_WIDE, LAST_CODE, CodeRanges, complement, merged

MAX_CLOSURE_WORK = 4_000_000  # states one lookahead's automaton may visit in all (a nested counted one is refused)
REPEAT_COUNT = re.compile(r"\{([0-9]*)(,?)([0-9]*)\}")


@dataclass(frozen=True, slots=True)
class Chars:
    """A set of characters: the ASCII ones as a bit mask, and the non-ASCII ones as code point ranges."""

    ascii: int
    wide: CodeRanges = ()

    @staticmethod
    def span(low: int, high: int) -> Chars:
        """The code points from low to high."""
        ascii_part = bits(range(low, min(high, 0x7F) + 1))
        return Chars(ascii_part, ((max(low, FIRST_WIDE), high),) if high >= FIRST_WIDE else ())

    def __or__(self, other: Chars) -> Chars:
        """The characters of either set."""
        return Chars(self.ascii | other.ascii, merged(self.wide + other.wide))

    def negated(self) -> Chars:
        """Every character not in the set."""
        return Chars(ASCII & ~self.ascii, complement(self.wide))

    def __and__(self, other: Chars) -> Chars:
        """The characters of both sets."""
        return (self.negated() | other.negated()).negated()

    def __bool__(self) -> bool:
        """Whether the set holds a character."""
        return bool(self.ascii or self.wide)


@dataclass(frozen=True, slots=True)
class Text:
    """A literal non-ASCII character."""

    char: str


@dataclass(frozen=True, slots=True)
class Concat:
    """Parts one after another."""

    parts: tuple[RegexNode, ...]


@dataclass(frozen=True, slots=True)
class Alternation:
    """Any one of the options."""

    options: tuple[RegexNode, ...]


@dataclass(frozen=True, slots=True)
class Repeat:
    """A part `least` to `most` times (any number where None)."""

    part: RegexNode
    least: int
    most: int | None


@dataclass(frozen=True, slots=True)
class Ahead:
    """A lookahead where it stands inside a pattern: the rest of the string must match one of its options (or, where
    `negative`, none of them), from there."""

    options: tuple[LookOption, ...]
    negative: bool


RegexNode = Chars | Text | Concat | Alternation | Repeat | Ahead


@dataclass(frozen=True, slots=True)
class LookOption:
    """An option of a lookahead at a top-level option's start: a match of `tree` begins the string, or where `whole`
    (the option ended in '$', and `tree` ends in the newline '$' may stand before) is all of it."""

    tree: RegexNode
    whole: bool


@dataclass(frozen=True, slots=True)
class Guarded:
    """A top-level option of a pattern: the strings of `tree` that none of the exclusions before it (negative
    lookaheads' options, (?!a|b) as (?!a)(?!b)) matches, and that each requirement (a positive lookahead, any one of
    its options) matches."""

    tree: RegexNode
    exclusions: tuple[LookOption, ...] = ()
    requirements: tuple[tuple[LookOption, ...], ...] = ()


@dataclass(frozen=True, slots=True)
class Pattern:
    """A parsed pattern: the strings of any of its top-level options."""

    options: tuple[Guarded, ...]


EVERY_WIDE = ((FIRST_WIDE, LAST_CODE),)
ANY_BUT_NEWLINE = Chars(ASCII & ~(1 << ord("\n")), EVERY_WIDE)
EVERY_CHAR = Chars(ASCII, EVERY_WIDE)
WIDE_SPACES = ((0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A), (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F),
               (0x3000, 0x3000), (0xFEFF, 0xFEFF))  # fmt: skip
CLASS_ESCAPES = {
    "d": Chars(DIGITS),
    "w": Chars(bits(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")),
    # ECMA-262's white space and line terminators, as a JSON Schema pattern reads \s (and its \S refuses them)
    "s": Chars(bits(b" \t\n\r\f\v"), WIDE_SPACES),
}
CLASS_ESCAPES |= {name.upper(): chars.negated() for name, chars in CLASS_ESCAPES.items()}
CHAR_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "0": "\0"}


def other_keys(names: Iterable[str]) -> Pattern:
    """Strings of any characters other than the names (each excluded as the whole string)."""
    excluded = (LookOption(Concat(tuple(Chars.span(ord(c), ord(c)) for c in name)), whole=True) for name in names)
    return Pattern((Guarded(Repeat(EVERY_CHAR, 0, None), tuple(excluded)),))


class RegexParser:
    """Parses the regex subset guided decoding supports into a tree (\\d and \\w are ASCII only, as ECMA-262's and
    re.ASCII's; \\s also takes ECMA-262's non-ASCII spaces); anything else is refused with a GrammarError naming
    `where`."""

    def __init__(self, pattern: str, where: str) -> None:
        self.pattern = pattern
        self.where = where
        self.position = 0
        self.depth = 0  # groups open
        self.excluding = False  # in a lookahead, where a '$' may end an option
        self.excluded_whole = False  # the lookahead's option being parsed ended in '$'

    def parse(self) -> Pattern:
        """The whole pattern, option by option; a '^' opening an option and a '$' where a match ends are dropped, as
        the match is always whole; lookaheads at an option's start (negative ones as in pydantic's Decimal pattern,
        positive ones as in a password's rules) guard that option, and those inside (condecimal's) are `Ahead`
        nodes."""
        options = []
        while not options or self._accept("|"):
            self._accept("^")  # each top-level option may open with it: the match is whole anyway
            options.append(self._guarded())
        if self.position < len(self.pattern):
            raise self._error("unbalanced ')'")
        return Pattern(tuple(options))

    def _guarded(self) -> Guarded:
        """A top-level option and the lookaheads it opens with."""
        exclusions: list[LookOption] = []
        requirements: list[tuple[LookOption, ...]] = []
        while True:
            if self._accept("(?!"):
                exclusions += self._look_options(at_start=True)
            elif self._accept("(?="):
                requirements.append(tuple(self._look_options(at_start=True)))
            else:
                return Guarded(self._sequence(), tuple(exclusions), tuple(requirements))

    def _look_options(self, at_start: bool) -> list[LookOption]:
        """A lookahead's options after its '(?!' or '(?=', to its ')'; a '$' may end an option, outside any group, and
        a '^' open a lookahead `at_start` of a top-level option (elsewhere it could match nothing but the start)."""
        if at_start:
            self._accept("^")
        elif self._peek() == "^":
            raise self._error("a '^' is taken only in a lookahead at the start of an option")
        exclusions, self.excluding = [], True
        while True:
            self.excluded_whole = False
            tree = self._sequence()
            if self.excluded_whole:  # Python's '$' also matches before a newline that ends the string
                tree = Concat((tree, Repeat(Chars(1 << ord("\n")), 0, 1)))
            exclusions.append(LookOption(tree, self.excluded_whole))
            if not self._accept("|"):
                break
        self.excluding = False
        if not self._accept(")"):
            raise self._error("missing ')'")
        return exclusions

    def _error(self, message: str) -> GrammarError:
        """A GrammarError at the current position."""
        return GrammarError(f"{message} at position {self.position} of the pattern", self.where)

    def _peek(self) -> str | None:
        """The next character, not taken."""
        return self.pattern[self.position] if self.position < len(self.pattern) else None

    def _take(self) -> str:
        """The next character, taken; the end of the pattern is an error."""
        char = self._peek()
        if char is None:
            raise self._error("unexpected end")
        self.position += 1
        return char

    def _accept(self, text: str) -> bool:
        """Take `text` if it comes next."""
        if self.pattern.startswith(text, self.position):
            self.position += len(text)
            return True
        return False

    def _alternation(self) -> RegexNode:
        """Sequences joined by '|'."""
        options = [self._sequence()]
        while self._accept("|"):
            options.append(self._sequence())
        return options[0] if len(options) == 1 else Alternation(tuple(options))

    def _sequence(self) -> RegexNode:
        """Repeated atoms up to a '|', a ')' or the end."""
        parts = []
        while (char := self._peek()) is not None and char not in "|)":
            if char == "$" and not self.excluding and self._ends_whole_match():
                self.position += 1  # the match is whole anyway
                continue
            if char == "$" and self._ends_excluded_option():
                self.position += 1
                self.excluded_whole = True
                continue
            parts.append(self._repeated())
        return parts[0] if len(parts) == 1 else Concat(tuple(parts))

    def _ends_whole_match(self) -> bool:
        """Whether the '$' here ends what a match takes: only the ')'s of the groups open follow it, then the end of
        the pattern or a '|' of its top level."""
        rest = self.pattern[self.position + 1 :]
        closing = len(rest) - len(rest.lstrip(")"))
        return closing == self.depth and rest[closing : closing + 1] in ("", "|")

    def _ends_excluded_option(self) -> bool:
        """Whether the '$' here ends an option of a lookahead (a '|' or its ')' comes next, outside any group)."""
        following = self.pattern[self.position + 1 : self.position + 2]
        return self.excluding and self.depth == 0 and following != "" and following in "|)"

    def _repeated(self) -> RegexNode:
        """An atom and its quantifier, if any (a lazy one matches the same whole strings)."""
        atom = self._atom()
        bounds = self._quantifier()
        if bounds is None:
            return atom
        self._accept("?")
        if (char := self._peek()) is not None and char in "*+?{":
            raise self._error("a repeat of a repeat (possessive or nested quantifiers) is not supported")
        if bounds[1] != 1 and has_ahead(atom):
            raise self._error("a lookahead inside a repeat is not supported")
        return Repeat(atom, *bounds)

    def _quantifier(self) -> tuple[int, int | None] | None:
        """The bounds of a quantifier taken here, or None."""
        for symbol, bounds in (("*", (0, None)), ("+", (1, None)), ("?", (0, 1))):
            if self._accept(symbol):
                return bounds
        if self._peek() != "{":
            return None
        match = REPEAT_COUNT.match(self.pattern, self.position)
        if match is None or not (match.group(1) or match.group(3)):
            raise self._error("a '{' that does not start a repeat count must be escaped")
        self.position = match.end()
        if max(len(match.group(n).lstrip("0")) for n in (1, 3)) > len(str(MAX_REPEAT)):  # not read: of any length
            raise self._error(f"repeat counts above {MAX_REPEAT} are not supported")
        least = int(match.group(1) or 0)
        most = least if not match.group(2) else (int(match.group(3)) if match.group(3) else None)
        if max(least, most or 0) > MAX_REPEAT:
            raise self._error(f"repeat counts above {MAX_REPEAT} are not supported")
        if most is not None and least > most:
            raise self._error("a repeat's minimum is above its maximum")
        return least, most

    def _atom(self) -> RegexNode:
        """A group, class, '.', escape or literal character."""
        char = self._take()
        if char in "*+?{":
            raise self._error(f"nothing to repeat before '{char}'")
        if char == "(":
            return self._group()
        if char == "[":
            return self._char_class()
        if char == ".":
            return ANY_BUT_NEWLINE
        if char in "^$":
            raise self._error("'^' is only accepted where a top-level option begins, and '$' where a match ends")
        if char == "\\":
            return self._char(self._escape())
        if 0xD800 <= ord(char) <= 0xDFFF:
            raise self._error("a lone surrogate is not a character")
        return self._char(char)

    def _group(self) -> RegexNode:
        """A group's content, after its '(': plain, non-capturing or named, or a lookahead (`Ahead`)."""
        for opening, negative in (("?=", False), ("?!", True)):
            if self._accept(opening):
                if self.excluding:
                    raise self._error("a lookahead inside a lookahead is not supported")
                depth, self.depth = self.depth, 0  # a '$' ends the lookahead's options at its own top level
                options = self._look_options(at_start=False)
                self.depth = depth
                return Ahead(tuple(options), negative)
        if self._accept("?") and not self._accept(":"):
            self._group_name()
        self.depth += 1
        tree = self._alternation()
        self.depth -= 1
        if not self._accept(")"):
            raise self._error("missing ')'")
        return tree

    def _group_name(self) -> None:
        """Take a group's name after its '(?': 'P<name>' or '<name>'; lookarounds, flags and the rest are refused."""
        if not (self._accept("P<") or self._accept("<")) or (self._peek() or "=") in "=!":
            raise self._error(
                "only (?:...), named groups, (?!...) and (?=...) are supported (no lookbehinds, flags or references)"
            )
        name, closed, _ = self.pattern[self.position :].partition(">")
        if not closed or not name.isidentifier():
            raise self._error("a group name must be an identifier followed by '>'")
        self.position += len(name) + 1

    def _char_class(self) -> Chars:
        """A class's characters, after its '[' (a ']' first is a member, as in Python)."""
        negate = self._accept("^")
        chars = Chars(0)
        first = True
        while (char := self._take()) != "]" or first:
            first = False
            low = self._class_member(char)
            if isinstance(low, Chars):
                chars |= low
            elif self._peek() == "-" and self.pattern[self.position + 1 : self.position + 2] not in ("", "]"):
                self.position += 1
                high = self._class_member(self._take())
                if isinstance(high, Chars) or ord(high) < ord(low):
                    raise self._error("bad class range")
                chars |= Chars.span(ord(low), ord(high))
            else:
                chars |= Chars.span(ord(low), ord(low))
        return chars.negated() if negate else chars

    def _class_member(self, char: str) -> Chars | str:
        """A class member: a shorthand class or one character."""
        return self._escape() if char == "\\" else char

    def _escape(self) -> Chars | str:
        """What an escape after its backslash stands for: a shorthand class or one character."""
        char = self._take()
        if char in CLASS_ESCAPES:
            return CLASS_ESCAPES[char]
        if char == "0" and self.pattern[self.position : self.position + 1].isdigit():
            raise self._error("'\\0' followed by a digit (an octal escape) is not supported")
        if char in CHAR_ESCAPES:
            return CHAR_ESCAPES[char]
        if char in "ux":
            digits = self.pattern[self.position : self.position + (4 if char == "u" else 2)]
            if len(digits) != (4 if char == "u" else 2) or not all(d in "0123456789abcdefABCDEF" for d in digits):
                raise self._error(f"'\\{char}' needs {4 if char == 'u' else 2} hex digits")
            self.position += len(digits)
            code = int(digits, 16)
            if 0xD800 <= code < 0xE000:
                raise self._error("a surrogate is not a character")
            return chr(code)
        if char.isascii() and not char.isalnum():
            return char
        raise self._error(f"'\\{char}' is not supported")

    def _char(self, member: Chars | str) -> RegexNode:
        """The tree of one matched character or shorthand class."""
        if isinstance(member, Chars):
            return member
        return Chars(1 << ord(member)) if member.isascii() else Text(member)


class CharacterAutomaton:
    """A regex tree as states joined by single characters (a Chars or Text each) and epsilons, from `first` to
    `last`; counted repeats are laid out copy by copy."""

    def __init__(self, tree: RegexNode, where: str) -> None:
        self.where = where  # the pattern's place, which a pattern too large to lay out is refused naming
        self.size = 0
        self.work = 0  # states its closures have visited
        self.moves: dict[int, list[tuple[Chars | Text, int]]] = {}
        self.epsilons: dict[int, list[int]] = {}
        self.aheads: list[Ahead] = []  # the lookaheads inside, in the order laid out
        self.marks: dict[tuple[int, int], int] = {}  # an epsilon where a lookahead stands -> its index in `aheads`
        self.first = self._state()
        self.last = self._build(self.first, tree)

    def closure(self, states: set[int]) -> frozenset[int]:
        """The states and those their epsilons reach (refused past MAX_CLOSURE_WORK states in all)."""
        found, pending = set(states), list(states)
        while pending:
            for target in self.epsilons.get(pending.pop(), ()):
                if target not in found:
                    found.add(target)
                    pending.append(target)
        self.work += len(found)
        if self.work > MAX_CLOSURE_WORK:
            raise GrammarError("the pattern's lookahead is too large for guided decoding", self.where)
        return frozenset(found)

    def moves_from(self, states: frozenset[int]) -> list[tuple[Chars | Text, int]]:
        """The character edges out of the states."""
        return [move for state in states for move in self.moves.get(state, ())]

    def after(self, states: frozenset[int], chars: Chars) -> frozenset[int]:
        """The states after a character of `chars`, which each edge out of `states` takes all or none of."""
        taken: dict[Chars | Text, bool] = {}  # each atom tested once, however many edges carry it
        targets = set()
        for atom, target in self.moves_from(states):
            if atom not in taken:
                taken[atom] = bool(as_chars(atom) & chars)
            if taken[atom]:
                targets.add(target)
        return self.closure(targets)

    def _state(self) -> int:
        if self.size >= MAX_NODES:
            raise GrammarError("the pattern is too large for guided decoding", self.where)
        self.size += 1
        return self.size - 1

    def _epsilon(self, source: int, target: int) -> None:
        self.epsilons.setdefault(source, []).append(target)

    def _build(self, start: int, tree: RegexNode) -> int:
        """The tree's strings from `start`; answers the state they end in."""
        if isinstance(tree, Ahead):
            end = self._state()
            self._epsilon(start, end)
            self.marks[start, end] = len(self.aheads)
            self.aheads.append(tree)
            return end
        if isinstance(tree, Chars | Text):
            end = self._state()
            self.moves.setdefault(start, []).append((tree, end))
            return end
        if isinstance(tree, Concat):
            for part in tree.parts:
                start = self._build(start, part)
            return start
        if isinstance(tree, Alternation):
            end = self._state()
            for option in tree.options:
                self._epsilon(self._build(start, option), end)
            return end
        for _ in range(tree.least):
            start = self._build(start, tree.part)
        end = self._state()
        if tree.most is None:  # a loop: `end` takes the part again
            self._epsilon(start, end)
            self._epsilon(self._build(end, tree.part), end)
            return end
        for _ in range(tree.most - tree.least):
            self._epsilon(start, end)
            start = self._build(start, tree.part)
        self._epsilon(start, end)
        return end


Guards = tuple[frozenset[int], ...]  # each lookahead option's automaton's states after what was taken
ProductKey = tuple[int, int, Guards, int]  # (the pattern's state, the characters counted, the guards, requirements met)


class PatternProduct:
    """A pattern option's character automaton crossed with the count of characters taken (which stops at `most`, or
    stays at `least` once there where None) and with each lookahead option's automaton, followed as a set of its
    states: the exclusions' first, then the requirements' options, then the options of the lookaheads inside (empty
    until the path passes where one stands), and a bit for each requirement met (those inside met until then)."""

    def __init__(self, emitter: RegexEmitter, option: Guarded, least: int, most: int | None, where: str) -> None:
        self.emitter, self.least, self.most = emitter, least, most
        self.automaton = CharacterAutomaton(option.tree, where)
        looks = [(look, None) for look in option.exclusions]
        looks += [(look, index) for index, options in enumerate(option.requirements) for look in options]
        requirements, self.starting = len(option.requirements), len(looks)
        self.inside: list[tuple[list[int], int | None]] = []  # each lookahead inside: its options' places, requirement
        for ahead in self.automaton.aheads:
            index = None if ahead.negative else requirements
            requirements += not ahead.negative
            self.inside.append((list(range(len(looks), len(looks) + len(ahead.options))), index))
            looks += [(look, index) for look in ahead.options]
        # (automaton, whole, the requirement it is an option of: None for an exclusion)
        self.looks = [(CharacterAutomaton(look.tree, where), look.whole, index) for look, index in looks]
        self.every_requirement = (1 << requirements) - 1
        self.met_inside = sum(1 << index for _, index in self.inside if index is not None)
        self.nodes: dict[ProductKey, int] = {}
        self.pending: list[ProductKey] = []

    def emit(self, start: int) -> int:
        """The product's strings from `start`; answers the node they end at."""
        network = self.emitter.network
        end = network.node()
        started = tuple(
            look.closure({look.first}) if place < self.starting else frozenset()
            for place, (look, _, _) in enumerate(self.looks)
        )
        first = self._node(self.automaton.first, 0, started, self.met_inside)
        if first is None:
            return end  # an exclusion matches the empty string, or a requirement cannot be met: nothing is taken
        network.epsilon(start, first)
        while self.pending:
            key = self.pending.pop()
            state, count, guarded, met = key
            here = self.nodes[key]
            if state == self.automaton.last and count >= self.least and self._ends_well(guarded, met):
                network.epsilon(here, end)
            for target in self.automaton.epsilons.get(state, ()):
                ahead = self.automaton.marks.get((state, target))
                passed = (guarded, met) if ahead is None else self._passed(ahead, guarded, met)
                if (node := self._node(target, count, *passed)) is not None:
                    network.epsilon(here, node)
            if count == self.most:
                continue
            after = min(count + 1, self.least if self.most is None else self.most)
            for atom, target in self.automaton.moves.get(state, ()):
                for part, guarded_after in self._split(as_chars(atom), guarded):
                    if (node := self._node(target, after, guarded_after, met)) is not None:
                        network.epsilon(self.emitter.emit(here, part), node)
        return end

    def _node(self, state: int, count: int, guarded: Guards, met: int) -> int | None:
        """The network node of a product state, made and queued the first time; None where an exclusion's match
        begins what was taken, or a requirement can no longer be met (nothing from there is taken). A requirement
        whose option has matched a beginning is met, and its options are no longer followed."""
        for (look, whole, index), states in zip(self.looks, guarded, strict=True):
            if not whole and look.last in states:
                if index is None:
                    return None
                met |= 1 << index
        guarded = tuple(
            frozenset() if index is not None and met >> index & 1 else states
            for (_, _, index), states in zip(self.looks, guarded, strict=True)
        )
        alive = sum(
            {
                1 << index
                for (_, _, index), states in zip(self.looks, guarded, strict=True)
                if states and index is not None
            }
        )
        if self.every_requirement & ~met & ~alive:  # a requirement not met, none of its options still followed
            return None
        key = (state, count, guarded, met)
        if key not in self.nodes:
            self.nodes[key] = self.emitter.network.node()
            self.pending.append(key)
        return self.nodes[key]

    def _passed(self, ahead: int, guarded: Guards, met: int) -> tuple[Guards, int]:
        """The guards and requirements met once a path passes where the lookahead inside stands: its options start
        from there, and a requirement it is is not met yet."""
        places, index = self.inside[ahead]
        guarded = tuple(
            look.closure({look.first}) if place in places else states
            for place, ((look, _, _), states) in enumerate(zip(self.looks, guarded, strict=True))
        )
        return guarded, met if index is None else met & ~(1 << index)

    def _ends_well(self, guarded: Guards, met: int) -> bool:
        """Whether the string may end here: no exclusion matches all of it, and each requirement not met by a
        beginning has an option that matches all of it."""
        for (look, whole, index), states in zip(self.looks, guarded, strict=True):
            if look.last in states:
                if index is None and whole:
                    return False
                if index is not None:
                    met |= 1 << index
        return met == self.every_requirement

    def _split(self, chars: Chars, guarded: Guards) -> list[tuple[Chars, Guards]]:
        """The characters cut into parts each lookahead option's automaton takes alike, each with its states after
        it."""
        parts = [chars]
        for (look, _, _), states in zip(self.looks, guarded, strict=True):
            for cut in {as_chars(atom) for atom, _ in look.moves_from(states)}:  # each set once, however many edges
                parts = [piece for part in parts for piece in (part & cut, part & cut.negated()) if piece]
        return [
            (part, tuple(look.after(states, part) for (look, _, _), states in zip(self.looks, guarded, strict=True)))
            for part in parts
        ]


def length_range(tree: RegexNode) -> tuple[int, int | None]:
    """The fewest and most characters of the tree's strings (None: no most)."""
    if isinstance(tree, Ahead):
        return 0, 0
    if isinstance(tree, Chars | Text):
        return 1, 1
    if isinstance(tree, Concat):
        ranges = [length_range(part) for part in tree.parts]
        highs = [high for _, high in ranges]
        return sum(low for low, _ in ranges), None if None in highs else sum(h for h in highs if h is not None)
    if isinstance(tree, Alternation):
        ranges = [length_range(option) for option in tree.options]
        highs = [high for _, high in ranges]
        return min(low for low, _ in ranges), None if None in highs else max(h for h in highs if h is not None)
    low, high = length_range(tree.part)
    return low * tree.least, None if tree.most is None or (high is None and tree.most) else (high or 0) * tree.most


def within_lengths(tree: RegexNode, least: int, most: int | None) -> RegexNode | None:
    """The tree with its strings of `least` to `most` characters only, where its one repeat of a single character
    beside fixed-length parts can take the bounds (the usual '[a-z]+' and '[A-Z][a-z]*'); else None."""
    if least == 0 and most is None:
        return tree
    parts = tree.parts if isinstance(tree, Concat) else (tree,)
    ranges = [length_range(part) for part in parts]
    free = [i for i, (low, high) in enumerate(ranges) if low != high]
    if len(free) != 1 or not isinstance(repeat := parts[free[0]], Repeat) or not isinstance(repeat.part, Chars | Text):
        return None
    fixed = sum(low for i, (low, _) in enumerate(ranges) if i != free[0])
    low = max(repeat.least, least - fixed)
    high = repeat.most if most is None else most - fixed if repeat.most is None else min(repeat.most, most - fixed)
    if high is not None and low > high:
        return None
    bounded = Repeat(repeat.part, low, high)
    return Concat((*parts[: free[0]], bounded, *parts[free[0] + 1 :])) if isinstance(tree, Concat) else bounded


def has_ahead(tree: RegexNode) -> bool:
    """Whether a lookahead stands anywhere inside the tree."""
    if isinstance(tree, Ahead):
        return True
    if isinstance(tree, Concat | Alternation):
        return any(has_ahead(part) for part in (tree.parts if isinstance(tree, Concat) else tree.options))
    return isinstance(tree, Repeat) and has_ahead(tree.part)


def as_chars(atom: Chars | Text) -> Chars:
    """A character automaton's atom as a set of characters."""
    return atom if isinstance(atom, Chars) else Chars.span(ord(atom.char), ord(atom.char))


class RegexEmitter:
    """Adds a regex tree to a network, matching raw UTF-8, or inside a JSON string the characters as json.dumps
    writes them with ensure_ascii=False (", \\ and control characters escaped, the rest as they are)."""

    def __init__(self, network: Network, in_json_string: bool) -> None:
        self.network = network
        self.in_json_string = in_json_string

    def emit(self, start: int, tree: RegexNode) -> int:
        """The tree's strings from `start`."""
        network = self.network
        if isinstance(tree, Chars):
            return self._chars(start, tree)
        if isinstance(tree, Text):
            return network.literal(start, tree.char.encode())
        if isinstance(tree, Concat):
            for part in tree.parts:
                start = self.emit(start, part)
            return start
        if isinstance(tree, Alternation):
            return network.either(start, [partial(self.emit, tree=option) for option in tree.options])
        return network.repeat(start, partial(self.emit, tree=tree.part), tree.least, tree.most)

    def emit_pattern(
        self, start: int, pattern: Pattern, least: int = 0, most: int | None = None, where: str = "pattern"
    ) -> int:
        """The pattern's strings of `least` to `most` characters (or more where None) that no exclusion refuses;
        `where` is the pattern's place, named by the error of one too large to lay out."""
        options = [partial(self._option, option=o, least=least, most=most, where=where) for o in pattern.options]
        return self.network.either(start, options)

    def _option(self, start: int, option: Guarded, least: int, most: int | None, where: str) -> int:
        """A top-level option's strings within the lengths: as they are where its own lengths are within them, its
        one repeat of a character bounded where that can be done, else through the product."""
        shortest, longest = length_range(option.tree)
        least = 0 if least <= shortest else least
        most = None if most is not None and longest is not None and longest <= most else most
        if not option.exclusions and not option.requirements and not has_ahead(option.tree):
            bounded = within_lengths(option.tree, least, most)
            if bounded is not None:
                return self.emit(start, bounded)
        return PatternProduct(self, option, least, most, where).emit(start)

    def _chars(self, start: int, chars: Chars) -> int:
        """One character of the set, in well-formed UTF-8: where it holds every non-ASCII character ('.', a negated
        class) in `utf8_char`'s few nodes, as in a JSON string."""
        network = self.network
        plain = chars.ascii & STRING_ASCII if self.in_json_string else chars.ascii
        end = network.node()
        if plain:
            network.move(start, plain, end)
        if self.in_json_string:
            escaped = [json.dumps(chr(code))[1:-1].encode() for code in members(chars.ascii & ~STRING_ASCII)]
            if escaped:
                network.epsilon(network.literals(start, escaped), end)
        if chars.wide == EVERY_WIDE:
            utf8_char(network, start, end)
        elif chars.wide:
            wide_chars(network, start, chars.wide, end)
        return end


def regex_grammar(pattern: str) -> Grammar:
    """Outputs that fully match the pattern (as re.fullmatch under re.ASCII, over the output's text)."""
    if not isinstance(pattern, str):
        raise GrammarError("a pattern must be a string", "pattern")
    network = Network("pattern")
    entry, exit_node = network.routine()
    end = RegexEmitter(network, in_json_string=False).emit_pattern(entry, RegexParser(pattern, "pattern").parse())
    network.epsilon(end, exit_node)
    return Grammar(network, entry)


def choice_grammar(choices: list[str]) -> Grammar:
    """Outputs equal to one of the strings."""
    if not isinstance(choices, list) or not choices:
        raise GrammarError("a choice needs a non-empty list of strings", "choice")
    for index, choice in enumerate(choices):
        if not isinstance(choice, str):
            raise GrammarError("each choice must be a string", f"choice[{index}]")
        if any(0xD800 <= ord(char) <= 0xDFFF for char in choice):
            raise GrammarError("a choice may not hold a lone surrogate (it is no UTF-8 text)", f"choice[{index}]")
    network = Network("choice")
    entry, exit_node = network.routine()
    network.epsilon(network.literals(entry, [choice.encode() for choice in choices]), exit_node)
    return Grammar(network, entry)
