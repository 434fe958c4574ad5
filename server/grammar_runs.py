"""Counted repeats' copies that behave alike: a grammar unrolls `{1000}` or a `maxLength` into one copy of its part
per count, so every position in the run is a new state. Copies far from the run's ends take the same bytes for as
long as a token lasts, so their states share one mask: `Runs.canonical` names the copy that stands for them."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

RUN_COPIES = 8  # the fewest copies of a part worth indexing


@dataclass(frozen=True, slots=True)
class Copy:
    """One copy of a repeated part: the node it starts from, the nodes made for it, and the node it ends at."""

    start: int
    first: int  # the first node made for the copy
    stop: int  # one past the last node made for it
    end: int


Edges = tuple[tuple[tuple[int, int], ...], tuple[int, ...], tuple[tuple[int, int], ...]]
"""A node's byte moves (mask, target), epsilon targets and calls (entry, return node)."""


@dataclass(frozen=True, slots=True)
class Stretch:
    """Consecutive copies laid out alike (every node's edges the same, a target in the same copy or the next read
    relative to it): copy i's nodes are `first + i * size` onwards, for i from 0 to `count` - 1."""

    first: int
    size: int
    count: int

    @property
    def end(self) -> int:
        """One past the stretch's last node."""
        return self.first + self.size * self.count

    def stand_in(self, node: int, horizon: int) -> int:
        """The node of the stretch's first copy that takes the same bytes as `node` for `horizon` bytes, or `node`
        where the stretch ends too soon after it: no edge leads back a copy, a path of k bytes reaches at most k + 1
        copies on, and a state's closure one more, so both stay inside the stretch."""
        index, position = divmod(node - self.first, self.size)
        if index + horizon + 3 > self.count:
            return node
        return self.first + position


class Runs:
    """The stretches of a grammar's counted repeats, found from the network's copies and the grammar's edges."""

    def __init__(self, stretches: list[Stretch]) -> None:
        """Stretches nest or lie apart (an inner run's lies inside one copy of an outer one's): each is kept with the
        innermost one holding it, an outer one before an inner one that starts at the same node."""
        self._stretches = sorted(stretches, key=lambda stretch: (stretch.first, -stretch.end))
        self._firsts = [stretch.first for stretch in self._stretches]
        self._parents: list[int] = []  # the index of the innermost stretch holding each, or -1
        holding: list[int] = []
        for index, stretch in enumerate(self._stretches):
            while holding and self._stretches[holding[-1]].end <= stretch.first:
                holding.pop()
            self._parents.append(holding[-1] if holding else -1)
            holding.append(index)

    @classmethod
    def of(cls, runs: Sequence[Sequence[Copy]], edges: Sequence[Edges], exits: frozenset[int]) -> Runs:
        """The stretches within each run of copies (copies of one size, each ending where the next starts)."""
        stretches = []
        for copies in runs:
            stretches.extend(find_stretches(copies, edges, exits))
        return cls(stretches)

    def __bool__(self) -> bool:
        """Whether any stretch was found."""
        return bool(self._stretches)

    def canonical(self, node: int, horizon: int) -> int:
        """The node that stands for `node` over `horizon` bytes: moved to the first copy of the innermost stretch
        holding it that can move it, then again from there (an outer run's copy, then an inner one's), else itself."""
        while True:
            index = bisect_right(self._firsts, node) - 1  # the last stretch to start at or before the node
            while index >= 0 and node >= self._stretches[index].end:  # it ends before the node: try its holders
                index = self._parents[index]
            moved = node
            while index >= 0 and moved == node:
                moved = self._stretches[index].stand_in(node, horizon)
                index = self._parents[index]
            if moved == node:
                return node
            node = moved


def find_stretches(copies: Sequence[Copy], edges: Sequence[Edges], exits: frozenset[int]) -> list[Stretch]:
    """The maximal stretches of a run's copies whose layouts match, checked safe to stand in for one another."""
    if len(copies) < RUN_COPIES:
        return []
    size = copies[0].stop - copies[0].first
    if size <= 0 or any(
        copy.first != copies[0].first + index * size
        or copy.stop != copy.first + size
        or copy.end - copy.first != copies[0].end - copies[0].first
        or (index and copy.start != copies[index - 1].end)
        for index, copy in enumerate(copies)
    ):
        return []
    first = copies[0].first
    end = copies[0].end - first
    if not 0 <= end < size:
        return []
    layouts = [layout(first + index * size, size, edges, exits) for index in range(len(copies))]
    stretches, begin = [], 0
    for index in range(1, len(layouts) + 1):
        if index == len(layouts) or layouts[index] != layouts[begin]:
            count = index - begin
            if count >= RUN_COPIES and is_safe(layouts[begin], end):
                stretches.append(Stretch(first + begin * size, size, count))
            begin = index
    return stretches


Place = tuple[
    int, int
]  # a node in the copy before, the same or the next as (offset -1, 0 or 1, position), else (2, node)


def layout(first: int, size: int, edges: Sequence[Edges], exits: frozenset[int]) -> tuple:
    """A copy's edges with targets in the copy before, itself and the next given by place, and whether each node is
    an exit: two copies with equal layouts behave alike as long as their neighbours do too."""

    def place(node: int) -> Place:
        offset, position = divmod(node - first, size)
        return (offset, position) if -1 <= offset <= 1 else (2, node)

    nodes = []
    for node in range(first, first + size):
        moves, epsilons, calls = edges[node]
        nodes.append(
            (
                node in exits,
                tuple((mask, place(target)) for mask, target in moves),
                tuple(place(target) for target in epsilons),
                tuple((place(entry), place(back)) for entry, back in calls),
            )
        )
    return tuple(nodes)


def is_safe(copy_layout: tuple, end: int) -> bool:
    """Whether a stretch's copies can stand in for one another: no edge leads to the copy before, edges reach the
    next copy only from the copy's end node, and no path without a byte leads from a copy's start (the end node of
    the copy before) to its own end node, so that k bytes move at most k + 1 copies on."""
    for position, (_, moves, epsilons, calls) in enumerate(copy_layout):
        targets = [target for _, target in moves] + list(epsilons) + [place for call in calls for place in call]
        for offset, _ in targets:
            if offset == -1 or (offset == 1 and position != end):
                return False
    # a path without a byte, from the copy's start (the end node of the copy before) to its own end node
    seen, pending = set(), [(-1, end)]
    while pending:
        offset, position = pending.pop()
        if (offset, position) == (0, end):
            return False
        if (offset, position) in seen or offset not in (-1, 0):
            continue
        seen.add((offset, position))
        _, _, epsilons, calls = copy_layout[position]
        for target_offset, where in [*epsilons, *(place for call in calls for place in call)]:
            if target_offset != 2:
                pending.append((offset + target_offset, where))
    return True
