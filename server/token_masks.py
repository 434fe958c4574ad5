"""Which token ids a grammar allows next: each token's bytes, and the masks a grammar's states give over them."""

from __future__ import annotations

import json
import re
import threading
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Sequence
from itertools import pairwise
from typing import Any

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
SPLIT_TRIES = 4  # a trie's splits kept (or loops met once), by the set of bytes that loop back to a state
# a state taking at least this many bytes that lead back to it (a string's characters) takes the keys made of them
# without walking them; fewer (a number's digits) leave too many keys to walk for the split to pay
LOOP_BYTES = 32
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
    """A vocabulary's distinct non-empty byte strings in sorted order, a trie laid flat: each key with its token ids
    and the length of the prefix it shares with the key before it."""

    def __init__(self, keys: list[bytes], ids: list[tuple[int, ...]], shared: list[int], byte_sets: list[int]) -> None:
        """Sorted distinct keys, their ids, the prefix each shares with the one before, and each key's bytes as bits."""
        self.keys, self.ids, self.shared, self.byte_sets = keys, ids, shared, byte_sets
        self._splits: OrderedDict[int, tuple[list[int], ByteTrie] | None] = OrderedDict()

    @classmethod
    def of(cls, pieces: Sequence[bytes | None]) -> ByteTrie:
        """The trie of a vocabulary's token bytes (None and empty pieces left out)."""
        ids: dict[bytes, list[int]] = {}
        for token_id, piece in enumerate(pieces):
            if piece:
                ids.setdefault(piece, []).append(token_id)
        keys = sorted(ids)
        shared = [0] + [shared_prefix(before, key) for before, key in pairwise(keys)]
        byte_sets = [sum(1 << byte for byte in set(key)) for key in keys]
        return cls(keys, [tuple(ids[key]) for key in keys], shared, byte_sets)

    def split(self, loop: int) -> tuple[list[int], ByteTrie] | None:
        """The ids of the keys whose every byte is in `loop` (a bit per byte), and the trie of the other keys; None
        the first time a loop is asked for (a loop met once, such as one pattern's, is cheaper walked than split),
        made the second time and kept for later states with the same loop (a JSON string's)."""
        if loop not in self._splits:
            self._splits[loop] = None
            split = None
        else:
            split = self._splits.pop(loop) or self._split(loop)
            self._splits[loop] = split
        while len(self._splits) > SPLIT_TRIES:
            self._splits.popitem(last=False)
        return split

    def _split(self, loop: int) -> tuple[list[int], ByteTrie]:
        """`split`'s parts. The other keys' shared prefixes come from this trie's: two sorted keys share the least
        of the prefixes shared by the keys from one to the other."""
        held = [not byte_set & ~loop for byte_set in self.byte_sets]
        inside = [token for key_held, key_ids in zip(held, self.ids, strict=True) if key_held for token in key_ids]
        kept = [index for index, key_held in enumerate(held) if not key_held]
        part = ByteTrie(
            [self.keys[i] for i in kept],
            [self.ids[i] for i in kept],
            [0] + [min(self.shared[a + 1 : b + 1]) for a, b in pairwise(kept)],
            [self.byte_sets[i] for i in kept],
        )
        return inside, part

    def skip(self, index: int, length: int) -> int:
        """The first key after `index` that does not start with the first `length` bytes of key `index`."""
        prefix = self.keys[index][:length].rstrip(b"\xff")
        if not prefix:
            return len(self.keys)
        above = prefix[:-1] + bytes([prefix[-1] + 1])
        return bisect_left(self.keys, above, index + 1)


def shared_prefix(first: bytes, second: bytes) -> int:
    """The length of the prefix two byte strings share."""
    length = min(len(first), len(second))
    for index in range(length):
        if first[index] != second[index]:
            return index
    return length


class TokenVocabulary:
    """Each token id's bytes as it adds them to the output (None for special tokens, which a grammar never allows),
    the model's vocabulary width, and tries over the bytes for walking them under a grammar: one of the tokens of
    at most HORIZON bytes and one of the longer ones."""

    def __init__(self, pieces: Sequence[bytes | None], size: int) -> None:
        self.size = size
        self._pieces = list(pieces[:size])
        self.trie = ByteTrie.of([piece if piece and len(piece) <= HORIZON else None for piece in self._pieces])
        self.long_trie = ByteTrie.of([piece if piece and len(piece) > HORIZON else None for piece in self._pieces])

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

    def _cached(self, cache: OrderedDict[State, torch.Tensor], key: State) -> torch.Tensor | None:
        """A cached mask, marked as the latest used; None where missing."""
        with self._lock:
            mask = cache.get(key)
            if mask is not None:
                cache.move_to_end(key)
            return mask

    def _keep(self, cache: OrderedDict[State, torch.Tensor], key: State, mask: torch.Tensor) -> torch.Tensor:
        """Cache a mask, the least recently used going where the cache is full."""
        with self._lock:
            cache[key] = mask
            while len(cache) > self._capacity:
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
        stands in for), the long ones walked from the state itself, then the end ids."""
        stand_in = self.grammar.stand_in(state, HORIZON) if len(state) <= STAND_IN_STACKS else state
        short = self._cached(self._short, stand_in)
        long_trie = self.vocabulary.long_trie
        walks = short is None or bool(long_trie.keys)
        # the bytes that lead from the state back to it, found once for both walks where there are any
        loop = sum(1 << byte for byte in range(256) if self.grammar.step(state, byte) == state) if walks else 0
        if short is None:
            ids, widest = self._walk(state, loop, self.vocabulary.trie)
            short = self._mask_of(ids)
            if widest * STAND_IN_STACKS <= MAX_STACKS:  # else the cap on stacks could tell the states apart
                self._keep(self._short, stand_in, short)
        mask = short.clone()
        if long_trie.keys:
            mask[torch.tensor(self._walk(state, loop, long_trie)[0], dtype=torch.long)] = True
        mask[self._end_index] = False
        ends = self.grammar.accepts(state) or not mask.any()
        return mask.index_fill_(0, self._end_index, ends)

    def _mask_of(self, ids: list[int]) -> torch.Tensor:
        """A bool mask over the vocabulary, True at the ids."""
        mask = torch.zeros(self.vocabulary.size, dtype=torch.bool)
        mask[torch.tensor(ids, dtype=torch.long)] = True
        return mask

    def _walk(self, state: State, loop: int, trie: ByteTrie) -> tuple[list[int], int]:
        """The ids of a trie's keys whose bytes the grammar takes from `state`, and the most stacks a closure visited
        on the way (Grammar.width). A key whose every byte is in `loop`, the bytes that lead from `state` back to it
        (inside a JSON string: most of the vocabulary), is taken without a walk; the others are walked in order, each
        from the state after the prefix it shares with the key before; a refused byte skips every key that starts
        with the bytes up to it."""
        step = self.grammar.step
        allowed: list[int] = []
        split = trie.split(loop) if loop.bit_count() >= LOOP_BYTES else None
        if split is not None:
            inside, trie = split
            allowed = list(inside)
        keys, shared, ids = trie.keys, trie.shared, trie.ids
        path = [state]  # path[d]: the state after the first d bytes of the key walked
        stepped_from = {state}  # every state a byte was fed to (few distinct ones: states repeat along keys)
        index = 0
        while index < len(keys):
            key = keys[index]
            del path[min(shared[index], len(path) - 1) + 1 :]
            current: State | None = path[-1]
            for byte in key[len(path) - 1 :]:
                current = step(current, byte)
                if current is None:
                    break
                path.append(current)
                stepped_from.add(current)
            if current is None:
                index = trie.skip(index, len(path))
            else:
                allowed.extend(ids[index])
                index += 1
        return allowed, max(map(self.grammar.width, stepped_from))
