"""Which token ids a grammar allows next: each token's bytes, and the masks a grammar's states give over them."""

from __future__ import annotations

import json
import re
import threading
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from server.grammar import MAX_STACKS, Grammar, State

ENDED: State = frozenset()  # the state after an end id; no grammar state is empty (Grammar.step answers None instead)
MASK_CACHE_BYTES = 1 << 25  # bytes of cached masks per grammar, at most MASK_CACHE_STATES of them
MASK_CACHE_STATES = 4096
# tokens of at most this many bytes are masked once for all the states that stand in for one another over as many
# bytes (Grammar.stand_in: a long counted repeat's places); the few longer ones are walked from each state
HORIZON = 16
# a state of at most this many stacks shares the short tokens' mask of its stand-in, where the walk that made it met
# no closure of more than MAX_STACKS // STAND_IN_STACKS stacks: then none of the state's own closures over those
# bytes (at most one such closure per stack) can pass MAX_STACKS, whose cut the stand-in does not keep
STAND_IN_STACKS = 16
# a walk looks the next depth up whole where at least 1 / DENSE_DEPTH of a depth's nodes live, else only the live
# nodes' children (gathered by their ranges, which costs more a node)
DENSE_DEPTH = 4
NOT_LOOKED_UP = -2  # a StepTable's entry for a step not looked up yet (-1: the byte is refused)
# a walk goes on key by key in Python once at most this many nodes a depth left lie below the live ones: a depth's
# tensor ops cost about as much as this many nodes walked in Python, however few nodes the depth holds (a deep,
# narrow trie, such as long runs of one byte, has many depths of a few nodes)
TAIL_NODES_A_DEPTH = 16
BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> byte: printable bytes stand for themselves, the other 68 for
    chr(256 + n), numbered in byte order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    alphabet = {}
    shifted = 0
    for byte in range(256):
        if byte in printable:
            alphabet[chr(byte)] = byte
        else:
            alphabet[chr(256 + shifted)] = byte
            shifted += 1
    return alphabet


BYTE_LEVEL_ALPHABET = byte_level_alphabet()


def byte_level_bytes(token: str) -> bytes:
    """A byte-level BPE token's bytes (a token outside the alphabet, which no merge makes, as its UTF-8)."""
    if all(char in BYTE_LEVEL_ALPHABET for char in token):
        return bytes(BYTE_LEVEL_ALPHABET[char] for char in token)
    return token.encode()


def names_byte_level(component: Any) -> bool:
    """Whether a tokenizer.json decoder or pre-tokenizer is ByteLevel, or a sequence holding one."""
    if not isinstance(component, dict):
        return False
    if component.get("type") == "ByteLevel":
        return True
    parts = component.get("decoders") or component.get("pretokenizers") or []
    return any(names_byte_level(part) for part in parts)


def is_byte_level(tokenizer: Any) -> bool:
    """Whether a transformers tokenizer is a byte-level BPE one (its fast backend says so)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    config = json.loads(backend.to_str())
    return names_byte_level(config.get("decoder")) or names_byte_level(config.get("pre_tokenizer"))


def sentencepiece_bytes(token: str) -> bytes:
    """A sentencepiece-style token's bytes: '▁' is a space and '<0xHH>' the byte HH."""
    fallback = BYTE_FALLBACK.fullmatch(token)
    return bytes([int(fallback.group(1), 16)]) if fallback else token.replace("▁", " ").encode()


class ByteTrie:
    """A vocabulary's distinct non-empty byte strings (keys) as a trie laid out a depth at a time in index tensors
    (TrieLevel), the keys numbered in the order their end nodes come, depth by depth; and each token id's key."""

    def __init__(self, pieces: Sequence[bytes | None]) -> None:
        """The trie of a vocabulary's token bytes (None and empty pieces left out)."""
        ids: dict[bytes, list[int]] = {}
        for token_id, piece in enumerate(pieces):
            if piece:
                ids.setdefault(piece, []).append(token_id)
        self.keys = sorted(ids)
        keys = self.keys
        self.token_ids = torch.tensor([token_id for key in keys for token_id in ids[key]], dtype=torch.long)
        self.end_of_id = torch.zeros(0, dtype=torch.long)  # the number of each of token_ids' key
        self.key_numbers = torch.zeros(0, dtype=torch.long)  # each sorted key's number
        self.shared: list[int] = []  # each sorted key's prefix shared with the key before it
        self.levels: list[TrieLevel] = []
        self.nodes = 0
        if not keys:
            return
        lengths = torch.tensor([len(key) for key in keys])
        depth = int(lengths.max())
        padded = torch.frombuffer(bytearray(b"".join(key.ljust(depth, b"\0") for key in keys)), dtype=torch.uint8)
        padded = padded.view(len(keys), depth).long()
        # each key's prefix shared with the key before it: in sorted keys a node opens where that is shorter than it
        differs = padded[1:] != padded[:-1]
        first_difference = torch.where(differs.any(1), differs.int().argmax(1), depth)
        shared = torch.cat((torch.zeros(1, dtype=torch.long), first_difference))
        shared[1:] = torch.minimum(shared[1:], torch.minimum(lengths[1:], lengths[:-1]))
        self.shared = shared.tolist()
        node_of_key = torch.zeros(len(keys), dtype=torch.long)  # each key's node one depth up
        # each depth's bytes, parents (non-decreasing, as the keys are sorted), nodes where keys end, and each node's
        # keys: from its first to its last member (any key sorted between two with a prefix has it too)
        depths = []
        ended = []  # each depth's keys ending there, in their nodes' order: the order of the walk's ends
        for at in range(depth):
            members = (lengths > at).nonzero().squeeze(1)
            opens = shared[members] <= at
            firsts = members[opens]
            parents = node_of_key[firsts]
            node_of_key[members] = opens.cumsum(0) - 1
            ends = (lengths == at + 1).nonzero().squeeze(1)
            ended.append(ends)
            lasts = members[torch.cat((opens.nonzero().squeeze(1)[1:], torch.tensor([len(members)]))) - 1] + 1
            depths.append((padded[firsts, at], parents, node_of_key[ends], firsts, lasts))
        self.key_numbers = torch.empty(len(keys), dtype=torch.long)
        self.key_numbers[torch.cat(ended)] = torch.arange(len(keys))
        self.end_of_id = self.key_numbers[torch.tensor([index for index, key in enumerate(keys) for _ in ids[key]])]
        below = torch.zeros(0, dtype=torch.long)  # the nodes below each node of the depth below
        for at in reversed(range(depth)):
            data, parents, end_nodes, firsts, lasts = depths[at]
            children = torch.zeros(len(data) + 1, dtype=torch.long)
            if at + 1 < depth:
                children[1:] = torch.bincount(depths[at + 1][1], minlength=len(data)).cumsum(0)
            sums = torch.cat((torch.zeros(1, dtype=torch.long), (below + 1).cumsum(0)))
            below = sums[children[1:]] - sums[children[:-1]]
            self.levels.append(TrieLevel(data, parents, children, end_nodes, firsts, lasts, below))
        self.levels.reverse()
        self.nodes = sum(len(level.data) for level in self.levels)

    def __len__(self) -> int:
        """The keys held."""
        return len(self.keys)

    def skip(self, index: int, length: int, end: int) -> int:
        """The first sorted key after `index` (and before `end`) that does not start with key `index`'s first
        `length` bytes."""
        prefix = self.keys[index][:length].rstrip(b"\xff")
        if not prefix:
            return end
        return bisect_left(self.keys, prefix[:-1] + bytes([prefix[-1] + 1]), index + 1, end)


@dataclass(frozen=True, slots=True)
class TrieLevel:
    """One depth of a ByteTrie: each node's byte, its parent in the depth above, its children's range (`children[n]`
    to `children[n + 1]`) in the depth below; the nodes where keys end, ascending; and each node's keys, the sorted
    keys from `first_keys[n]` to before `last_keys[n]`, and how many nodes lie below it."""

    data: torch.Tensor
    parents: torch.Tensor
    children: torch.Tensor
    end_nodes: torch.Tensor
    first_keys: torch.Tensor
    last_keys: torch.Tensor
    below: torch.Tensor


class StepTable:
    """The grammar's steps from the states one walk meets, numbered in the order met (the walk's start is 0): a flat
    table of the number after each byte at (number * 256 + byte), -1 where the byte is refused and -2 where not
    looked up yet, then one -1 for every step from a dead node (-1)."""

    def __init__(self, grammar: Grammar, start: State) -> None:
        self.grammar = grammar
        self.states = [start]
        self.cut = False  # whether the cap on stacks refused a step looked up (Grammar.refused_by_cap)
        self._numbers = {start: 0}
        self._table = torch.cat((torch.full((256,), NOT_LOOKED_UP, dtype=torch.long), torch.tensor([-1])))

    def after(self, numbers: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
        """The numbers of the states after each byte from each numbered state (-1 for a refused byte or from -1)."""
        codes = (numbers * 256 + data).clamp_(min=-1)  # from -1: the table's last entry
        after = self._table[codes]
        missing = after == NOT_LOOKED_UP
        if bool(missing.any()):
            wanted = torch.zeros(len(self._table), dtype=torch.bool)
            wanted[codes[missing]] = True
            self._look_up(wanted.nonzero().squeeze(1))
            after = self._table[codes]
        return after

    def widest(self) -> int:
        """The most stacks a closure visited in the steps from the states met (Grammar.width)."""
        return max(map(self.grammar.width, self.states))

    def _look_up(self, codes: torch.Tensor) -> None:
        """Fill the table at (number * 256 + byte) codes from the grammar, numbering the new states."""
        found = []
        for code in codes.tolist():
            state, byte = self.states[code >> 8], code & 255
            after = self.grammar.step(state, byte)
            if after is None and self.grammar.refused_by_cap(state, byte):
                self.cut = True
            number = -1 if after is None else self._numbers.setdefault(after, len(self.states))
            if number == len(self.states):
                self.states.append(after)
            found.append(number)
        self._table[codes] = torch.tensor(found, dtype=torch.long)
        rows = (len(self._table) - 1) // 256
        if len(self.states) > rows:  # room for twice the states, so that many new ones cost few copies
            fresh = torch.full(((2 * len(self.states) - rows) * 256,), NOT_LOOKED_UP, dtype=torch.long)
            self._table = torch.cat((self._table[:-1], fresh, self._table[-1:]))


class TokenVocabulary:
    """Each token id's bytes as it adds them to the output (None for special tokens, which a grammar never allows),
    the model's vocabulary width, and tries over the bytes for walking them under a grammar: one of the tokens of
    at most HORIZON bytes and one of the longer ones."""

    def __init__(self, pieces: Sequence[bytes | None], size: int) -> None:
        self.size = size
        self._pieces = list(pieces[:size])
        self.trie = ByteTrie([piece if piece and len(piece) <= HORIZON else None for piece in self._pieces])
        self.long_trie = ByteTrie([piece if piece and len(piece) > HORIZON else None for piece in self._pieces])

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, vocab_size: int) -> TokenVocabulary:
        """The bytes of a transformers tokenizer's tokens (byte-level BPE, or sentencepiece-style with '▁' and
        '<0xHH>' tokens) over a vocabulary `vocab_size` wide; ids past the tokenizer's own have none."""
        count = min(len(tokenizer), vocab_size)
        special = set(tokenizer.all_special_ids)
        added = getattr(tokenizer, "added_tokens_decoder", {})
        decode = byte_level_bytes if is_byte_level(tokenizer) else sentencepiece_bytes
        pieces: list[bytes | None] = []
        for token_id, token in enumerate(tokenizer.convert_ids_to_tokens(list(range(count)))):
            added_token = added.get(token_id)
            if token_id in special or token is None or (added_token is not None and added_token.special):
                pieces.append(None)
            elif added_token is not None:
                pieces.append(added_token.content.encode())
            else:
                pieces.append(decode(token))
        return cls(pieces, vocab_size)

    def token_bytes(self, token_id: int) -> bytes | None:
        """The bytes a token adds to the output; None for special tokens and ids the tokenizer lacks."""
        return self._pieces[token_id] if 0 <= token_id < len(self._pieces) else None


Kept = TypeVar("Kept")


class GuideMasks:
    """A grammar over a vocabulary: each state's allowed ids (cached per state, and the short tokens' per state that
    stands in for it) and the state after a token."""

    def __init__(self, grammar: Grammar, vocabulary: TokenVocabulary, end_ids: tuple[int, ...]) -> None:
        self.grammar = grammar
        self.vocabulary = vocabulary
        self.end_ids = tuple(end_id for end_id in end_ids if 0 <= end_id < vocabulary.size)  # others are never drawn
        self._end_index = torch.tensor(self.end_ids, dtype=torch.long)
        self._ended = torch.zeros(vocabulary.size, dtype=torch.bool).index_fill_(0, self._end_index, True)
        self._cache: OrderedDict[State, torch.Tensor] = OrderedDict()  # by state: the whole mask
        # states whose masks are cut (`cut`), the latest MASK_CACHE_STATES: more than the packed masks a Guides keeps,
        # which outlive this cache's masks at a large vocabulary
        self._cut: OrderedDict[State, None] = OrderedDict()
        self._short: OrderedDict[State, torch.Tensor] = OrderedDict()  # by stand-in: the short tokens' mask
        self._capacity = max(1, min(MASK_CACHE_STATES, MASK_CACHE_BYTES // 2 // max(vocabulary.size, 1)))
        self._lock = threading.Lock()

    def allowed(self, state: State) -> torch.Tensor:
        """A bool mask [vocabulary.size], True where the id may come next (cached: read it, never write it). A
        token is allowed where the grammar takes all its bytes; the end ids where the grammar accepts the output so
        far, and also at a dead end, where no token is allowed, so that the output can still end."""
        if state == ENDED:
            return self._ended
        mask = self._cached(self._cache, state)
        if mask is None:
            mask = self._keep(self._cache, state, self._build(state))
        return mask

    def cut(self, state: State) -> bool:
        """Whether the state's mask, made before, may leave out tokens the grammar takes: a step its walk looked up
        held more stacks than the grammar's cap (MAX_STACKS), so the grammar refused it (only a wildly ambiguous
        grammar gets there). Read from the states noted when masks were made, never by making one."""
        with self._lock:
            return state in self._cut

    def _cached(self, cache: OrderedDict[State, Kept], key: State) -> Kept | None:
        """A cached mask, marked as the latest used; None where missing."""
        with self._lock:
            mask = cache.get(key)
            if mask is not None:
                cache.move_to_end(key)
            return mask

    def _keep(self, cache: OrderedDict[State, Kept], key: State, mask: Kept, capacity: int | None = None) -> Kept:
        """Cache a mask, the least recently used going past `capacity` (the mask caches' where None)."""
        with self._lock:
            cache[key] = mask
            while len(cache) > (capacity or self._capacity):
                cache.popitem(last=False)
        return mask

    def advance(self, state: State, token_id: int) -> State | None:
        """The state after a token; None where the token is not allowed. An allowed end id leads to ENDED, after
        which only end ids are allowed (each leading to ENDED again)."""
        if token_id in self.end_ids:
            return ENDED if bool(self.allowed(state)[token_id]) else None
        piece = self.vocabulary.token_bytes(token_id)
        if state == ENDED or not piece:
            return None
        return self.grammar.feed(state, piece)

    def _build(self, state: State) -> torch.Tensor:
        """A state's mask: the short tokens' from the state that stands in for it (walked once for all the states it
        stands in for), the long ones walked from the state itself, then the end ids; a mask whose walks the cap on
        stacks cut is noted (`cut`; a stand-in's mask is kept only from a walk far below the cap, so none is cut)."""
        stand_in = self.grammar.stand_in(state, HORIZON) if len(state) <= STAND_IN_STACKS else state
        short, cut = self._cached(self._short, stand_in), False
        if short is None:
            ids, widest, cut = self._walk(state, self.vocabulary.trie)
            short = torch.zeros(self.vocabulary.size, dtype=torch.bool).index_fill_(0, ids, True)
            if widest * STAND_IN_STACKS <= MAX_STACKS:  # else the cap on stacks could tell the states apart
                self._keep(self._short, stand_in, short)
        mask = short.clone()
        if len(self.vocabulary.long_trie):
            ids, _, long_cut = self._walk(state, self.vocabulary.long_trie)
            mask.index_fill_(0, ids, True)
            cut = cut or long_cut
        if cut:
            self._keep(self._cut, state, None, MASK_CACHE_STATES)
        mask[self._end_index] = False
        ends = self.grammar.accepts(state) or not mask.any()
        return mask.index_fill_(0, self._end_index, ends)

    def _walk(self, state: State, trie: ByteTrie) -> tuple[torch.Tensor, int, bool]:
        """The ids of a trie's keys whose bytes the grammar takes from `state`, the most stacks a closure visited
        on the way (Grammar.width), and whether the cap on stacks refused a step looked up. A depth at a time, each
        node's state looked up from its parent's and its byte in a table of the steps met (each worked out once by
        the grammar): where most of a depth's nodes live, the next depth whole, else only the live nodes' children;
        once few nodes lie below the live ones, their keys one by one."""
        steps = StepTable(self.grammar, state)
        taken = torch.zeros(len(trie), dtype=torch.bool)  # by key number
        numbered = 0  # keys numbered so far: those ending above this depth
        few = trie.nodes <= TAIL_NODES_A_DEPTH * len(trie.levels)
        tails = [(0, len(trie), 0, state)] if few else []  # (first, last key, depth, state) walked one by one
        nodes = None  # the nodes looked up at this depth (None: all of them)
        numbers = torch.zeros(len(trie.levels[0].data) if trie.levels and not tails else 0, dtype=torch.long)
        for at, level in enumerate(trie.levels if not tails else ()):
            numbers = steps.after(numbers, level.data if nodes is None else level.data[nodes])
            live = numbers >= 0
            if nodes is None:
                alive, live_nodes = None, live
            else:  # only the live ones kept
                alive, numbers = nodes[live], numbers[live]
                live_nodes = torch.zeros(len(level.data), dtype=torch.bool).index_fill_(0, alive, True)
            taken[numbered : numbered + len(level.end_nodes)] = live_nodes[level.end_nodes]
            numbered += len(level.end_nodes)
            count = int(live.sum()) if alive is None else len(alive)
            if not count or at + 1 == len(trie.levels):
                break
            if int(level.below[live_nodes].sum()) <= TAIL_NODES_A_DEPTH * (len(trie.levels) - at - 1):
                if alive is None:
                    alive, numbers = live.nonzero().squeeze(1), numbers[live]
                inner = level.below[alive] > 0  # the live nodes with nodes below them
                alive, numbers = alive[inner], numbers[inner]
                states = [steps.states[number] for number in numbers.tolist()]
                firsts, lasts = level.first_keys[alive].tolist(), level.last_keys[alive].tolist()
                tails = list(zip(firsts, lasts, [at + 1] * len(states), states, strict=True))
                break
            if count * DENSE_DEPTH >= len(level.data):  # the next depth whole, from every node's number
                if alive is not None:
                    numbers = torch.full((len(level.data),), -1, dtype=torch.long).index_put_((alive,), numbers)
                numbers, nodes = numbers[trie.levels[at + 1].parents], None
                continue
            if alive is None:
                alive = live.nonzero().squeeze(1)
                numbers = numbers[alive]
            firsts = level.children[alive]  # the live nodes' children
            counts = level.children[alive + 1] - firsts
            numbers = numbers.repeat_interleave(counts)
            nodes = torch.arange(len(numbers)) + (firsts - (counts.cumsum(0) - counts)).repeat_interleave(counts)
        keys: list[int] = []
        met: set[State] = set()
        cut = steps.cut
        for first, last, depth, start in tails:
            cut = self._walk_keys(trie, first, last, depth, start, keys, met) or cut
        taken[trie.key_numbers[torch.tensor(keys, dtype=torch.long)]] = True
        return trie.token_ids[taken[trie.end_of_id]], max([steps.widest(), *map(self.grammar.width, met)]), cut

    def _walk_keys(
        self, trie: ByteTrie, first: int, last: int, depth: int, start: State, taken: list[int], met: set[State]
    ) -> bool:
        """Of the sorted keys from `first` to before `last`, which share their first `depth` bytes, add to `taken`
        those whose other bytes the grammar takes from `start`, and to `met` the states met: walked in order, each
        from the state after the prefix it shares with the key before; a refused byte skips every key that starts
        with the bytes up to it. Answers whether the cap on stacks refused a step."""
        step, cut = self.grammar.step, False
        path = [start]  # path[d]: the state after the first depth + d bytes of the key walked
        met.add(start)
        index = first
        while index < last:
            key = trie.keys[index]
            if index > first:  # keys in the range share at least their first `depth` bytes
                del path[trie.shared[index] - depth + 1 :]
            current: State | None = path[-1]
            for byte in key[depth + len(path) - 1 :]:
                current = step(current, byte)
                if current is None:
                    cut = cut or self.grammar.refused_by_cap(path[-1], byte)
                    break
                path.append(current)
                met.add(current)
            if current is None:
                index = trie.skip(index, depth + len(path), last)
            else:
                taken.append(index)
                index += 1
        return cut
