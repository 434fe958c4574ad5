"""Grammars in EBNF, as vLLM's `guided_grammar` takes them (xgrammar's notation, of which llama.cpp's GBNF grammars are
a part): rules `name ::= expression`, the whole output matching the rule named root."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field

from server.grammar import ASCII, MAX_REPEAT, Grammar, GrammarError, Network
from server.grammar_regex import EVERY_WIDE, Alternation, Chars, Concat, RegexEmitter, RegexNode, Repeat, Text

ROOT = "root"
NAME = re.compile(r"[A-Za-z_-][A-Za-z0-9_.-]*")  # '.' first would be any character
RULE_START = re.compile(r"([A-Za-z_-][A-Za-z0-9_.-]*)[ \t]*(::=|\[|\()")  # a rule's name, then ::= (or an option)
REPEAT_COUNT = re.compile(r"\{[ \t]*([0-9]+)[ \t]*(?:(,)[ \t]*([0-9]*)[ \t]*)?\}")
CONTROL_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "b": "\b", "f": "\f", "a": "\a", "v": "\v", "0": "\0", "e": "\x1b"}
SELF_ESCAPES = "\"\\/'?"  # escapes that stand for the character itself, in strings and classes
CLASS_SELF_ESCAPES = SELF_ESCAPES + "^$.*+()[]{}|-"  # and these in classes
HEX_LENGTHS = {"u": 4, "U": 8}  # and \\x takes one or more
HEX_DIGITS = re.compile(r"[0-9a-fA-F]+")


@dataclass(frozen=True, slots=True)
class RuleRef:
    """A use of a rule by name, and the offset in the grammar's text where it stands (no part of its identity)."""

    name: str
    position: int = field(compare=False)


EbnfNode = RegexNode | RuleRef


LARK_RULE = re.compile(r"[?!]?[A-Za-z_][\w]*\s*:(?!:)")  # a Lark rule's head, which vLLM converts and this refuses


class EbnfParser:
    """Parses a grammar's text into each rule's tree; anything outside the notation is a GrammarError naming the line
    and column where it stands."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.position = 0
        self.rules: dict[str, EbnfNode] = {}
        self.defined_at: dict[str, int] = {}  # each rule's name's offset

    def parse(self) -> dict[str, EbnfNode]:
        """Every rule's tree, by name."""
        self._skip_space()
        while self.position < len(self.text):
            position = self.position
            start = RULE_START.match(self.text, self.position)
            if start is None and "::=" not in self.text and LARK_RULE.match(self.text, self.position):
                raise self._error("a Lark grammar (`name: expression`) is not supported; write it in GBNF, "
                                  "`name ::= expression`, with a `root` rule")  # fmt: skip
            if start is None:
                raise self._error("expected a rule, written `name ::= expression`")
            if start.group(2) != "::=":
                raise self._error("rule options (`name[...]`) and macros (`Name(...)`) are not supported")
            name = start.group(1)
            if name in self.rules:
                raise self._error(f"rule {name!r} is defined twice (first at {self.where(self.defined_at[name])})")
            self.position = start.end()
            self.defined_at[name] = position
            self.rules[name] = self._alternation()
            if self._peek() == ")":
                raise self._error("unbalanced ')'")
        return self.rules

    def where(self, position: int | None = None) -> str:
        """A position (the current one where None) as 'line L, column C', both counted from 1."""
        position = self.position if position is None else position
        line = self.text.count("\n", 0, position) + 1
        column = position - (self.text.rfind("\n", 0, position) + 1) + 1
        return f"line {line}, column {column}"

    def _error(self, message: str, position: int | None = None) -> GrammarError:
        """A GrammarError at a position (the current one where None)."""
        return GrammarError(message, self.where(position))

    def _skip_space(self) -> None:
        """Skip whitespace, line breaks and comments (`#` to the end of the line)."""
        while self.position < len(self.text):
            char = self.text[self.position]
            if char == "#":
                end = self.text.find("\n", self.position)
                self.position = len(self.text) if end < 0 else end
            elif char in " \t\r\n":
                self.position += 1
            else:
                return

    def _peek(self) -> str | None:
        """The next character after any space, not taken."""
        self._skip_space()
        return self.text[self.position] if self.position < len(self.text) else None

    def _take(self, unended: str = "the grammar ends too soon") -> str:
        """The next character, taken as it is (no space skipped); the end of the text is an error (`unended`)."""
        if self.position >= len(self.text):
            raise self._error(unended)
        self.position += 1
        return self.text[self.position - 1]

    def _alternation(self) -> EbnfNode:
        """Sequences joined by '|'."""
        options = [self._sequence()]
        while self._peek() == "|":
            self.position += 1
            options.append(self._sequence())
        return options[0] if len(options) == 1 else Alternation(tuple(options))

    def _sequence(self) -> EbnfNode:
        """Repeated elements up to a '|', a ')', the next rule or the end."""
        parts = []
        while (char := self._peek()) is not None and char not in "|)" and not self._at_rule_start():
            parts.append(self._repeated())
        return parts[0] if len(parts) == 1 else Concat(tuple(parts))

    def _at_rule_start(self) -> bool:
        """Whether the next rule's definition starts here: its name first on its line, then '::='."""
        start = RULE_START.match(self.text, self.position)
        if start is None or start.group(2) != "::=":
            return False
        return not self.text[self.text.rfind("\n", 0, self.position) + 1 : self.position].strip()

    def _repeated(self) -> EbnfNode:
        """An element and its repetition, if any."""
        element = self._element()
        bounds = self._repetition()
        if bounds is None:
            return element
        if (char := self._peek()) is not None and char in "*+?{":
            raise self._error("two repetitions of one element: put it in parentheses first")
        return Repeat(element, *bounds)  # type: ignore[arg-type]

    def _repetition(self) -> tuple[int, int | None] | None:
        """The bounds of a repetition written right after an element, or None."""
        char = self._peek()
        for symbol, bounds in (("*", (0, None)), ("+", (1, None)), ("?", (0, 1))):
            if char == symbol:
                self.position += 1
                return bounds
        if char != "{":
            return None
        count = REPEAT_COUNT.match(self.text, self.position)
        if count is None:
            raise self._error("a repetition count is written {m}, {m,} or {m,n}")
        if max(len((count.group(n) or "").lstrip("0")) for n in (1, 3)) > len(str(MAX_REPEAT)):  # not read: any length
            raise self._error(f"repetition counts above {MAX_REPEAT} are not supported")
        least = int(count.group(1))
        most = least if not count.group(2) else (int(count.group(3)) if count.group(3) else None)
        if max(least, most or 0) > MAX_REPEAT:
            raise self._error(f"repetition counts above {MAX_REPEAT} are not supported")
        if most is not None and least > most:
            raise self._error("a repetition's minimum is above its maximum")
        self.position = count.end()
        return least, most

    def _element(self) -> EbnfNode:
        """A string, a class, '.', a group or a rule's name."""
        char = self._peek()
        if char == '"':
            self.position += 1
            return self._string()
        if char == "[":
            self.position += 1
            return self._char_class()
        if char == ".":
            self.position += 1
            return Chars(ASCII, EVERY_WIDE)
        if char == "(":
            self.position += 1
            tree = self._alternation()
            if self._peek() != ")":
                raise self._error("missing ')'")
            self.position += 1
            return tree
        name = NAME.match(self.text, self.position)
        if name is None:
            raise self._error(f"unexpected {char!r}" if char is not None else "the grammar ends too soon")
        position, self.position = self.position, name.end()
        if self.position < len(self.text) and self.text[self.position] == "(":
            raise self._error("macros (`Name(...)`) are not supported")
        return RuleRef(name.group(), position)

    def _string(self) -> EbnfNode:
        """A string literal's characters in order, after its opening quote."""
        parts: list[RegexNode] = []
        while (char := self._take("a string is not closed")) != '"':
            if char == "\n":
                raise self._error("a string cannot hold a line break: write \\n", self.position - 1)
            if char == "\\":
                char = self._escape(SELF_ESCAPES)
            elif 0xD800 <= ord(char) <= 0xDFFF:
                raise self._error("a lone surrogate is not a character", self.position - 1)
            parts.append(Chars(1 << ord(char)) if char.isascii() else Text(char))
        return parts[0] if len(parts) == 1 else Concat(tuple(parts))

    def _char_class(self) -> Chars:
        """A class's characters, after its '[': members, ranges `a-b`, negated by a leading '^'."""
        opening = self.position - 1
        negate = self.text.startswith("^", self.position)
        self.position += negate
        chars = Chars(0)
        empty = True
        while (char := self._take("a class is not closed")) != "]":
            empty = False
            member = self.position - 1
            low = self._class_char(char)
            if self.text.startswith("-", self.position) and not self.text.startswith("-]", self.position):
                self.position += 1
                high = self._class_char(self._take())
                if ord(high) < ord(low):
                    raise self._error("a class range ends below where it starts", member)
                chars |= Chars.span(ord(low), ord(high))
            else:
                chars |= Chars.span(ord(low), ord(low))
        if empty and not negate:
            raise self._error("an empty class matches nothing", opening)
        return chars.negated() if negate else chars

    def _class_char(self, char: str) -> str:
        """One member character of a class (an escape's character where it starts one)."""
        if char == "\n":
            raise self._error("a class cannot hold a line break: write \\n", self.position - 1)
        if 0xD800 <= ord(char) <= 0xDFFF:
            raise self._error("a lone surrogate is not a character", self.position - 1)
        return self._escape(CLASS_SELF_ESCAPES) if char == "\\" else char

    def _escape(self, self_escapes: str) -> str:
        """The character an escape stands for, after its backslash (errors name the backslash's place)."""
        backslash = self.position - 1
        char = self._take()
        if char in self_escapes:
            return char
        if char in CONTROL_ESCAPES:
            return CONTROL_ESCAPES[char]
        if char in "xuU":
            length = HEX_LENGTHS.get(char)
            digits = HEX_DIGITS.match(self.text, self.position, self.position + length if length else len(self.text))
            if digits is None or (length is not None and len(digits.group()) != length):
                raise self._error(f"'\\{char}' needs {length or 'one or more'} hex digits", backslash)
            self.position += len(digits.group())
            code = int(digits.group(), 16)
            if code > 0x10FFFF or 0xD800 <= code <= 0xDFFF:
                raise self._error(f"'\\{char}{digits.group()}' is not a character", backslash)
            return chr(code)
        if char in "dwsDWS":
            raise self._error(f"'\\{char}' is not supported: write its characters as a class, such as [0-9]", backslash)
        raise self._error(f"'\\{char}' is not an escape", backslash)


def nullable_rules(rules: dict[str, EbnfNode]) -> set[str]:
    """The rules that can match the empty text."""
    nullable: set[str] = set()
    while True:
        more = {name for name, tree in rules.items() if name not in nullable and _nullable(tree, nullable)}
        if not more:
            return nullable
        nullable |= more


def _nullable(tree: EbnfNode, nullable: set[str]) -> bool:
    """Whether the tree can match the empty text, given the rules known to."""
    if isinstance(tree, RuleRef):
        return tree.name in nullable
    if isinstance(tree, Concat):
        return all(_nullable(part, nullable) for part in tree.parts)
    if isinstance(tree, Alternation):
        return any(_nullable(option, nullable) for option in tree.options)
    if isinstance(tree, Repeat):
        return tree.least == 0 or _nullable(tree.part, nullable)
    return False


def leading_rules(tree: EbnfNode, nullable: set[str]) -> set[str]:
    """The rules the tree may use before it has matched any character."""
    if isinstance(tree, RuleRef):
        return {tree.name}
    if isinstance(tree, Concat):
        found: set[str] = set()
        for part in tree.parts:
            found |= leading_rules(part, nullable)
            if not _nullable(part, nullable):
                break
        return found
    if isinstance(tree, Alternation):
        return set().union(*(leading_rules(option, nullable) for option in tree.options))
    if isinstance(tree, Repeat):
        return leading_rules(tree.part, nullable) if tree.most != 0 else set()
    return set()


def used_rules(tree: EbnfNode) -> list[RuleRef]:
    """Every use of a rule in the tree, in order."""
    if isinstance(tree, RuleRef):
        return [tree]
    if isinstance(tree, Concat | Alternation):
        return [ref for part in (tree.parts if isinstance(tree, Concat) else tree.options) for ref in used_rules(part)]
    if isinstance(tree, Repeat):
        return used_rules(tree.part)
    return []


def on_a_cycle(edges: dict[str, set[str]]) -> list[str]:
    """The names from which some path of edges leads back to themselves, in the order of `edges`: the members of
    strongly connected components with more than one name or an edge to itself (Tarjan's walk, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    stacked: set[str] = set()
    cyclic: set[str] = set()

    def visit(name: str) -> tuple[str, Iterator[str]]:
        index[name] = low[name] = len(index)
        stack.append(name)
        stacked.add(name)
        return name, iter(sorted(edges[name]))

    for first in edges:
        if first in index:
            continue
        work = [visit(first)]
        while work:
            name, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    work.append(visit(target))
                elif target in stacked:
                    low[name] = min(low[name], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[name])
            if low[name] == index[name]:
                component = stack[stack.index(name) :]
                del stack[stack.index(name) :]
                stacked.difference_update(component)
                if len(component) > 1 or name in edges[name]:
                    cyclic.update(component)
    return [name for name in edges if name in cyclic]


def flattened(tree: EbnfNode) -> tuple[EbnfNode, ...]:
    """The parts of a sequence, those of sequences inside it spliced in (a string is a sequence of characters)."""
    if not isinstance(tree, Concat):
        return (tree,)
    return tuple(part for inner in tree.parts for part in flattened(inner))


def alternatives(tree: EbnfNode) -> Iterator[EbnfNode]:
    """The options of an alternation, those of alternations inside it spliced in (the tree itself if none)."""
    if isinstance(tree, Alternation):
        for option in tree.options:
            yield from alternatives(option)
    else:
        yield tree


def sequence(parts: tuple[EbnfNode, ...]) -> EbnfNode:
    """Parts as one tree: the part itself where there is one (none: the empty text)."""
    return parts[0] if len(parts) == 1 else Concat(parts)  # type: ignore[arg-type]


def factored(tree: EbnfNode) -> EbnfNode:
    """The tree with the options of each alternation that begin alike joined: `a b c | a b d` becomes `a b (c | d)`.
    The texts are the same; a match holds one place in `a b` rather than one per option, and where that beginning
    uses a recursive rule the places (stacks of calls) no longer double at each level of nesting. Options with the
    same first part are joined over all the parts they share, so a long shared beginning is one step, not one a
    part."""
    if isinstance(tree, Concat):
        return Concat(tuple(factored(part) for part in flattened(tree)))
    if isinstance(tree, Repeat):
        return Repeat(factored(tree.part), tree.least, tree.most)  # type: ignore[arg-type]
    if not isinstance(tree, Alternation):
        return tree
    by_first: dict[EbnfNode | None, dict[tuple[EbnfNode, ...], None]] = {}
    for option in alternatives(tree):
        parts = flattened(option)
        by_first.setdefault(parts[0] if parts else None, {})[parts[1:]] = None
    options: list[EbnfNode] = []
    for first, rests in by_first.items():
        if first is None:
            options.append(Concat(()))
            continue
        tails = list(rests)
        shared = 0
        while all(len(tail) > shared and tail[shared] == tails[0][shared] for tail in tails):
            shared += 1
        head = tuple(factored(part) for part in (first, *tails[0][:shared]))
        tails = [tail[shared:] for tail in tails]
        if len(tails) > 1:
            head += (factored(Alternation(tuple(sequence(tail) for tail in tails))),)
        options.append(sequence(head))
    return options[0] if len(options) == 1 else Alternation(tuple(options))  # type: ignore[arg-type]


class EbnfEmitter(RegexEmitter):
    """Adds rule trees to a network: a recursive rule as a routine that its uses call, its body added once from a
    queue (so a long chain of rules is never a deep recursion), any other rule inlined at each use (so a grammar
    without recursion is a plain automaton, as a regex is)."""

    def __init__(self, network: Network, rules: dict[str, EbnfNode], recursive: set[str]) -> None:
        super().__init__(network, in_json_string=False)
        self.rules, self.recursive = rules, recursive
        self.entries: dict[str, int] = {}
        self.bodies: list[tuple[str, int, int]] = []  # routines whose bodies are still to be added

    def emit(self, start: int, tree: EbnfNode) -> int:  # type: ignore[override]
        """The tree's texts from `start`."""
        if not isinstance(tree, RuleRef):
            return super().emit(start, tree)  # type: ignore[arg-type]
        if tree.name not in self.recursive:
            return self.emit(start, self.rules[tree.name])
        return self.network.call(start, self.routine(tree.name))

    def routine(self, name: str) -> int:
        """The entry of a rule's routine (its body queued the first time)."""
        if name not in self.entries:
            entry, exit_node = self.network.routine()
            self.entries[name] = entry
            self.bodies.append((name, entry, exit_node))
        return self.entries[name]

    def add_bodies(self) -> None:
        """Add the queued routines' bodies, and those of the routines they call in turn."""
        while self.bodies:
            name, entry, exit_node = self.bodies.pop()
            self.network.epsilon(self.emit(entry, self.rules[name]), exit_node)


def ebnf_grammar(text: str) -> Grammar:
    """Outputs that the grammar's rule `root` matches. Left recursion is refused (write it as a repetition), as are
    xgrammar's rule options and macros; '.' is any character. Options that begin alike are joined (`factored`)."""
    if not isinstance(text, str):
        raise GrammarError("a grammar must be a string", "grammar")
    parser = EbnfParser(text)
    rules = parser.parse()
    if ROOT not in rules:
        raise GrammarError(f"the grammar has no rule named {ROOT!r}, which the output matches", "grammar")
    uses = {name: used_rules(tree) for name, tree in rules.items()}
    for refs in uses.values():
        for ref in refs:
            if ref.name not in rules:
                raise GrammarError(f"rule {ref.name!r} is not defined", parser.where(ref.position))
    nullable = nullable_rules(rules)
    leading = {name: leading_rules(tree, nullable) for name, tree in rules.items()}
    left_recursive = on_a_cycle(leading)
    if left_recursive:
        name = left_recursive[0]
        raise GrammarError(
            f"rule {name!r} is left-recursive (it can reach itself before matching a character), which is not "
            'supported: write it with a repetition, such as `list ::= item ("," item)*`',
            parser.where(parser.defined_at[name]),
        )
    recursive = set(on_a_cycle({name: {ref.name for ref in refs} for name, refs in uses.items()}))
    network = Network("grammar")
    emitter = EbnfEmitter(network, {name: factored(tree) for name, tree in rules.items()}, recursive)
    try:
        if ROOT in recursive:
            entry = emitter.routine(ROOT)
        else:
            entry, exit_node = network.routine()
            network.epsilon(emitter.emit(entry, emitter.rules[ROOT]), exit_node)
        emitter.add_bodies()
    except RecursionError:
        raise GrammarError(
            "rules used inside one another too deeply to lay out (a chain of hundreds)", "grammar"
        ) from None
    return Grammar(network, entry)
