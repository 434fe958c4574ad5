"""The round header's versioned binary codec: encode_header(plan) -> bytes, decode_header(data) -> RoundPlan."""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Iterable, Sequence
from itertools import accumulate, chain, pairwise
from typing import Any

from rankwire.header import DrawSpec, LaneOp, LaneOpCode, LaneRows, RoundKind, RoundPlan

MAGIC = b"FNRH"
VERSION = 12  # 5: seeds may be negative; 6: draws carry a logit bias; 7: a logprobs count; 8: suppressed ids;
# 9: penalties; 10: allowed ids; 11: prompt-logprob flags; 12: guide masks
_PREFIX = struct.Struct("<4sHII")  # magic, version, total length, CRC-32 of the body
_COUNTS = struct.Struct("<BIIII")  # kind, then how many allocate slots, free slots, rows and lane ops
_SIZES = {code: struct.calcsize("<" + code) for code in "BHIiqd"}
_SIGNED = frozenset("iq")  # columns read as signed, where a negative value (a set top bit) is refused
_ANY_SIGN = frozenset({"seeds"})  # signed columns that may be negative: a draw takes its seed modulo 2**64
_KINDS = frozenset(RoundKind)
_CODES = frozenset(LaneOpCode)
_MAX_FINITE = math.nextafter(math.inf, 0.0)


class HeaderError(ValueError):
    """A round header that cannot be encoded or decoded; the message names what is wrong."""


def encode_header(plan: RoundPlan) -> bytes:
    """Encode a plan; raise HeaderError for a value the format cannot carry."""
    rows = plan.rows
    draws = [row.draw for row in rows if row.draw is not None]
    _check_draws([d.temperature for d in draws], [d.top_p for d in draws], [d.min_p for d in draws])
    _check_biases([draw.logit_bias for draw in draws])
    _check_penalties([draw.penalties for draw in draws])
    _check_allowed([draw.allowed_ids for draw in draws])
    bad = next((d.logprobs for d in draws if d.logprobs is not None and not 0 <= d.logprobs < 255), None)
    if bad is not None:
        raise HeaderError(f"cannot encode logprobs counts: {bad} is not in [0, 254]")
    unknown = {op.code for op in plan.ops} - _CODES
    if unknown:
        raise HeaderError(f"cannot encode unknown lane op code {min(unknown)}")
    for index, row in enumerate(rows):
        _check_prior_draw(index, row.prior_draw, row.token_ids, row.drafts, row.draft_depth)
        _check_prompt_logprobs(index, row.prompt_logprobs, row.prior_draw, len(row.drafts))
    mask_bytes = _check_guide_masks(rows)
    body = b"".join(
        (
            _pack_counts(plan, len(rows)),
            _pack("H", plan.allocate, "allocate slots"),
            _pack("H", plan.free, "free slots"),
            _pack("H", [row.slot for row in rows], "row slots"),
            _pack("q", [row.start for row in rows], "row starts"),
            _pack("I", [len(row.token_ids) for row in rows], "token counts"),
            _pack("I", [len(row.drafts) for row in rows], "draft counts"),
            _pack("B", [row.draw is not None for row in rows], "draw flags"),
            _pack("B", [row.draft_depth for row in rows], "draft depths"),
            _pack("i", chain.from_iterable(row.token_ids for row in rows), "token ids"),
            _pack("i", chain.from_iterable(row.drafts for row in rows), "draft ids"),
            _pack("d", [draw.temperature for draw in draws], "temperatures"),
            _pack("i", [draw.top_k for draw in draws], "top_k values"),
            _pack("d", [draw.top_p for draw in draws], "top_p values"),
            _pack("d", [draw.min_p for draw in draws], "min_p values"),
            _pack("q", [draw.seed for draw in draws], "seeds"),
            _pack("I", [len(draw.logit_bias) for draw in draws], "logit bias counts"),
            _pack("i", [token for draw in draws for token, _ in draw.logit_bias], "logit bias ids"),
            _pack("d", [bias for draw in draws for _, bias in draw.logit_bias], "logit biases"),
            _pack("B", [0 if draw.logprobs is None else draw.logprobs + 1 for draw in draws], "logprobs counts"),
            _pack("q", [draw.suppress_before for draw in draws], "suppression ends"),
            _pack("I", [len(draw.suppress_ids) for draw in draws], "suppressed id counts"),
            _pack("i", [token for draw in draws for token in draw.suppress_ids], "suppressed ids"),
            _pack("d", chain.from_iterable(draw.penalties for draw in draws), "penalties"),
            _pack("q", [draw.output_from for draw in draws], "output starts"),
            _pack("I", [len(draw.allowed_ids) for draw in draws], "allowed id counts"),
            _pack("i", [token for draw in draws for token in draw.allowed_ids], "allowed ids"),
            _pack("B", [op.code for op in plan.ops], "lane op codes"),
            _pack("H", [op.slot for op in plan.ops], "lane op slots"),
            _pack("q", [op.arg for op in plan.ops], "lane op arguments"),
            _pack("I", [op.after for op in plan.ops], "lane op row offsets"),
            _pack("B", [row.prior_draw for row in rows], "prior-draw flags"),
            _pack(
                "B",
                [0 if row.prompt_logprobs is None else row.prompt_logprobs + 1 for row in rows],
                "prompt-logprob counts",
            ),
            _pack("B", [len(row.guide_masks) for row in rows], "guide mask counts"),
            _pack("I", [mask_bytes], "guide mask length"),
            b"".join(mask for row in rows for mask in row.guide_masks),
        )
    )
    return _PREFIX.pack(MAGIC, VERSION, _PREFIX.size + len(body), zlib.crc32(body)) + body


def decode_header(data: bytes | bytearray | memoryview) -> RoundPlan:
    """Decode a header, raising HeaderError (naming the fault) for anything but a well-formed one."""
    if len(data) < _PREFIX.size + _COUNTS.size:
        raise HeaderError(f"truncated header: {len(data)} bytes, the fixed part alone is {_PREFIX.size + _COUNTS.size}")
    magic, version, length, crc = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise HeaderError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise HeaderError(f"unknown header version {version}, this build reads version {VERSION}")
    if length < _PREFIX.size + _COUNTS.size:
        raise HeaderError(f"declared length {length} is shorter than the fixed part")
    if len(data) < length:
        raise HeaderError(f"truncated header: {len(data)} of its declared {length} bytes")
    if len(data) > length:
        raise HeaderError(f"{len(data) - length} trailing bytes after the header's declared {length}")
    if zlib.crc32(memoryview(data)[_PREFIX.size :]) != crc:
        raise HeaderError(f"checksum mismatch: the header says {crc:#010x}")
    return _Reader(bytes(data)).plan()


class _Reader:
    """A cursor over a header's body that refuses to read past its end."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = _PREFIX.size

    def take(self, code: str, count: int, what: str) -> tuple[Any, ...]:
        """Read `count` little-endian values of struct type `code`."""
        size = _SIZES[code] * count
        left = len(self.data) - self.pos
        if size > left:
            raise HeaderError(f"{what}: {count} values need {size} bytes but {left} remain")
        values = struct.unpack_from(f"<{count}{code}", self.data, self.pos)
        _check_non_negative(code, self.data[self.pos : self.pos + size], values, what)
        self.pos += size
        return values

    def plan(self) -> RoundPlan:
        """Read the whole body as a RoundPlan."""
        kind, n_allocate, n_free, n_rows, n_ops = _COUNTS.unpack_from(self.data, self.pos)
        self.pos += _COUNTS.size
        if kind not in _KINDS:
            raise HeaderError(f"unknown round kind {kind}")
        allocate = self.take("H", n_allocate, "allocate slots")
        free = self.take("H", n_free, "free slots")
        slots = self.take("H", n_rows, "row slots")
        starts = self.take("q", n_rows, "row starts")
        token_counts = self.take("I", n_rows, "token counts")
        draft_counts = self.take("I", n_rows, "draft counts")
        flags = self.take("B", n_rows, "draw flags")
        if max(flags, default=0) > 1:
            raise HeaderError(f"draw flag {max(flags)} is neither 0 nor 1")
        depths = self.take("B", n_rows, "draft depths")
        token_ids = self.take("i", sum(token_counts), "token ids")
        draft_ids = self.take("i", sum(draft_counts), "draft ids")
        draws = self._draws(sum(flags))
        ops = self._ops(n_ops)
        priors = self.take("B", n_rows, "prior-draw flags")
        if max(priors, default=0) > 1:
            raise HeaderError(f"prior-draw flag {max(priors)} is neither 0 nor 1")
        stored = self.take("B", n_rows, "prompt-logprob counts")
        prompt_logprobs = tuple(None if count == 0 else count - 1 for count in stored)
        row_tokens = _cut(token_ids, token_counts)
        for index, prior in enumerate(priors):
            _check_prior_draw(index, bool(prior), row_tokens[index], range(draft_counts[index]), depths[index])
            _check_prompt_logprobs(index, prompt_logprobs[index], bool(prior), draft_counts[index])
        guide_masks = self._guide_masks(n_rows)
        if self.pos != len(self.data):
            raise HeaderError(f"{len(self.data) - self.pos} trailing bytes inside the header's body")
        rows = _rows(
            slots, starts, flags, depths, row_tokens, _cut(draft_ids, draft_counts), draws, priors, prompt_logprobs,
            guide_masks,
        )  # fmt: skip
        _check_guide_masks(rows)
        return RoundPlan(kind=RoundKind(kind), allocate=allocate, free=free, rows=rows, ops=ops)

    def _guide_masks(self, n_rows: int) -> list[tuple[bytes, ...]]:
        """Read each row's guide masks: their counts, the one length they share, then the masks."""
        counts = self.take("B", n_rows, "guide mask counts")
        (length,) = self.take("I", 1, "guide mask length")
        if length and not sum(counts):
            raise HeaderError(f"a guide mask length of {length} in a round without guide masks")
        size = length * sum(counts)
        if size > len(self.data) - self.pos:
            raise HeaderError(f"guide masks: {sum(counts)} of {length} bytes need {size} bytes but fewer remain")
        blob = self.data[self.pos : self.pos + size]
        self.pos += size
        masks = [blob[i : i + length] for i in range(0, size, length)] if length else [b""] * sum(counts)
        return _cut(tuple(masks), counts)

    def _draws(self, count: int) -> list[DrawSpec]:
        """Read the draw columns of the rows that draw."""
        temperatures = self.take("d", count, "temperatures")
        top_ks = self.take("i", count, "top_k values")
        top_ps = self.take("d", count, "top_p values")
        min_ps = self.take("d", count, "min_p values")
        seeds = self.take("q", count, "seeds")
        _check_draws(temperatures, top_ps, min_ps)
        bias_counts = self.take("I", count, "logit bias counts")
        ids = self.take("i", sum(bias_counts), "logit bias ids")
        values = self.take("d", sum(bias_counts), "logit biases")
        biases = _cut(tuple(zip(ids, values, strict=True)), bias_counts)
        _check_biases(biases)
        logprobs = [None if stored == 0 else stored - 1 for stored in self.take("B", count, "logprobs counts")]
        ends = self.take("q", count, "suppression ends")
        suppressed_counts = self.take("I", count, "suppressed id counts")
        suppressed = _cut(self.take("i", sum(suppressed_counts), "suppressed ids"), suppressed_counts)
        penalties = _cut(self.take("d", 3 * count, "penalties"), [3] * count)
        _check_penalties(penalties)
        output_starts = self.take("q", count, "output starts")
        allowed_counts = self.take("I", count, "allowed id counts")
        allowed = _cut(self.take("i", sum(allowed_counts), "allowed ids"), allowed_counts)
        _check_allowed(allowed)
        sampling = zip(temperatures, top_ks, top_ps, min_ps, seeds, biases, logprobs, suppressed, ends, strict=True)
        return [
            DrawSpec(*values, *penalty, output_from=start, allowed_ids=ids)
            for values, penalty, start, ids in zip(sampling, penalties, output_starts, allowed, strict=True)
        ]

    def _ops(self, count: int) -> tuple[LaneOp, ...]:
        """Read the lane operations."""
        codes = self.take("B", count, "lane op codes")
        unknown = set(codes) - _CODES
        if unknown:
            raise HeaderError(f"unknown lane op code {min(unknown)}")
        slots = self.take("H", count, "lane op slots")
        args = self.take("q", count, "lane op arguments")
        afters = self.take("I", count, "lane op row offsets")
        return tuple(map(LaneOp, map(LaneOpCode, codes), slots, args, afters))


def _rows(
    slots: tuple[int, ...],
    starts: tuple[int, ...],
    flags: tuple[int, ...],
    depths: tuple[int, ...],
    row_tokens: list[tuple[int, ...]],
    row_drafts: list[tuple[int, ...]],
    draws: list[DrawSpec],
    priors: tuple[int, ...],
    prompt_logprobs: tuple[int | None, ...],
    guide_masks: list[tuple[bytes, ...]],
) -> tuple[LaneRows, ...]:
    """Put the per-lane token and draft pieces and the draw columns back together as rows."""
    next_draw = iter(draws)
    return tuple(
        map(
            LaneRows,
            slots,
            row_tokens,
            starts,
            [next(next_draw) if flag else None for flag in flags],
            row_drafts,
            depths,
            map(bool, priors),
            prompt_logprobs,
            guide_masks,
        )
    )


def _cut(flat: tuple[Any, ...], counts: Sequence[int]) -> list[tuple[Any, ...]]:
    """A flat column cut into consecutive pieces of the given lengths."""
    return [flat[a:b] for a, b in pairwise(accumulate(counts, initial=0))]


def _pack_counts(plan: RoundPlan, n_rows: int) -> bytes:
    """Pack the kind and the section counts."""
    try:
        return _COUNTS.pack(RoundKind(plan.kind), len(plan.allocate), len(plan.free), n_rows, len(plan.ops))
    except (struct.error, ValueError) as exc:
        raise HeaderError(f"cannot encode the round kind or a count: {exc}") from None


def _pack(code: str, values: Iterable[Any], what: str) -> bytes:
    """Pack a whole column of little-endian values, naming the column if one does not fit."""
    items = tuple(values)
    try:
        packed = struct.pack(f"<{len(items)}{code}", *items)
    except struct.error as exc:
        raise HeaderError(f"cannot encode {what}: {exc}") from None
    _check_non_negative(code, packed, items, what)
    return packed


def _check_non_negative(code: str, packed: bytes, values: tuple[Any, ...], what: str) -> None:
    """Refuse a negative value in a signed column other than _ANY_SIGN's (checked on the packed bytes' sign bits)."""
    width = _SIZES[code]
    if code in _SIGNED and what not in _ANY_SIGN and not packed[width - 1 :: width].isascii():
        raise HeaderError(f"{what}: {min(values)} is negative")


def _check_prior_draw(index: int, prior: bool, token_ids: Sequence[int], drafts: Sequence[int], depth: int) -> None:
    """Refuse a prior-draw row that is not one row holding 0, without drafts to verify or to chain (a rank takes its
    token from the device, where its own host never sees it)."""
    if prior and (tuple(token_ids) != (0,) or len(drafts) or depth):
        raise HeaderError(f"row {index}: a prior-draw row is one token 0 with no drafts and no draft depth")


def _check_biases(biases: Sequence[tuple[tuple[int, float], ...]]) -> None:
    """Refuse a logit bias no draw can have: an id given twice, or a bias that is not a finite number."""
    for index, pairs in enumerate(biases):
        ids = [token for token, _ in pairs]
        if len(set(ids)) != len(ids):
            raise HeaderError(f"draw {index}: a logit bias gives one token id twice")
        bad = next((bias for _, bias in pairs if not math.isfinite(bias)), None)
        if bad is not None:
            raise HeaderError(f"draw {index}: logit bias {bad} is not a finite number")


def _check_prompt_logprobs(index: int, most: int | None, prior: bool, drafts: int) -> None:
    """Refuse a row asking for its prompt's logprobs that is not a prompt pass (a prior draw, or drafts to verify), or
    with a count the format cannot carry."""
    if most is not None and not 0 <= most < 255:
        raise HeaderError(f"row {index}: cannot encode prompt-logprob count {most}: not in [0, 254]")
    if most is not None and (prior or drafts):
        raise HeaderError(f"row {index}: a row with the prompt's logprobs takes no prior draw and no drafts")


def _check_guide_masks(rows: Sequence[LaneRows]) -> int:
    """Refuse guide masks no round can have: masks on a row that does not draw, a count other than its draw rows'
    (its drafts and one), an empty mask, or masks of different lengths in one round; the length they share (0: none)."""
    lengths = {len(mask) for row in rows for mask in row.guide_masks}
    if len(lengths) > 1 or 0 in lengths:
        raise HeaderError(f"guide masks of one round must share one length above 0, got lengths {sorted(lengths)}")
    for index, row in enumerate(rows):
        if row.guide_masks and (row.draw is None or len(row.guide_masks) != len(row.drafts) + 1):
            drawing = _draw_rows(row)
            raise HeaderError(f"row {index}: {len(row.guide_masks)} guide masks, but it draws at {drawing} rows")
    return lengths.pop() if lengths else 0


def _draw_rows(row: LaneRows) -> int:
    """How many rows of a lane's window draw: each draft's and one after them, none without a draw."""
    return 0 if row.draw is None else len(row.drafts) + 1


def _check_allowed(allowed: Sequence[tuple[int, ...]]) -> None:
    """Refuse allowed ids that give one id twice."""
    for index, ids in enumerate(allowed):
        if len(set(ids)) != len(ids):
            raise HeaderError(f"draw {index}: its allowed ids give one token id twice")


def _check_penalties(penalties: Sequence[tuple[float, float, float]]) -> None:
    """Refuse penalties no draw can have: a repetition penalty that is not a finite number > 0, or a frequency or
    presence penalty that is not finite."""
    for index, (repetition, frequency, presence) in enumerate(penalties):
        if not 0.0 < repetition <= _MAX_FINITE:
            raise HeaderError(f"draw {index}: repetition penalty {repetition} is not a finite number > 0")
        bad = next((value for value in (frequency, presence) if not math.isfinite(value)), None)
        if bad is not None:
            raise HeaderError(f"draw {index}: penalty {bad} is not a finite number")


def _check_draws(temperatures: Sequence[float], top_ps: Sequence[float], min_ps: Sequence[float]) -> None:
    """Refuse sampling values no draw can have: a NaN, a negative or infinite temperature, p outside [0, 1]."""
    for name, values, low, high, wanted in (
        ("temperature", temperatures, 0.0, _MAX_FINITE, "a finite number >= 0"),
        ("top_p", top_ps, 0.0, 1.0, "in [0, 1]"),
        ("min_p", min_ps, 0.0, 1.0, "in [0, 1]"),
    ):
        bad = next((index for index, value in enumerate(values) if not low <= value <= high), None)
        if bad is not None:
            raise HeaderError(f"draw {bad}: {name} {values[bad]} is not {wanted}")
