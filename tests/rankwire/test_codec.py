"""The round header codec: exact round trips, a pinned byte layout, and refusal (HeaderError, naming the fault) of
anything malformed: random bytes, truncations, corruptions."""

from __future__ import annotations

import math
import random
import re
import struct
import zlib
from dataclasses import replace

import pytest

from rankwire.codec import HeaderError, decode_header, encode_header
from rankwire.header import DrawSpec, LaneOp, LaneOpCode, LaneRows, RoundKind, RoundPlan

PREFIX = struct.Struct("<4sHII")
COUNTS = struct.Struct("<BIIII")


def seal(body: bytes, magic: bytes = b"FNRH", version: int = 12) -> bytes:
    """A header around `body` with a correct length and checksum, written from the documented layout."""
    return PREFIX.pack(magic, version, PREFIX.size + len(body), zlib.crc32(body)) + body


def random_draw(rng: random.Random) -> DrawSpec:
    return DrawSpec(
        temperature=rng.choice([0.0, 1.0, rng.uniform(0, 2), rng.uniform(0, 1e300)]),
        top_k=rng.choice([0, 1, rng.randrange(2**31)]),
        top_p=rng.choice([0.0, 1.0, rng.random()]),
        min_p=rng.choice([0.0, 1.0, rng.random()]),
        seed=rng.choice([0, 2**63 - 1, -(2**63), rng.randrange(-(2**63), 2**63)]),
        logit_bias=tuple(
            (token, rng.choice([-100.0, 100.0, 0.0, rng.uniform(-100, 100), rng.uniform(-1e300, 1e300)]))
            for token in rng.sample([0, 2**31 - 1, *range(1, 300)], rng.choice([0, 0, 1, rng.randrange(6)]))
        ),
        logprobs=rng.choice([None, None, 0, 254, rng.randrange(21)]),
        suppress_ids=tuple(rng.sample([0, 2**31 - 1, *range(1, 300)], rng.choice([0, 0, 1, rng.randrange(4)]))),
        suppress_before=rng.choice([0, 2**63 - 1, rng.randrange(1 << 20)]),
        repetition_penalty=rng.choice([1.0, 1.0, 5e-324, 1e300, rng.uniform(0.1, 2)]),
        frequency_penalty=rng.choice([0.0, 0.0, -2.0, 2.0, rng.uniform(-1e300, 1e300)]),
        presence_penalty=rng.choice([0.0, 0.0, -0.0, rng.uniform(-2, 2)]),
        output_from=rng.choice([0, 2**63 - 1, rng.randrange(1 << 20)]),
        allowed_ids=tuple(rng.sample([0, 2**31 - 1, *range(1, 300)], rng.choice([0, 0, 1, rng.randrange(5)]))),
    )


def random_ids(rng: random.Random, most: int) -> tuple[int, ...]:
    return tuple(rng.choice([0, 2**31 - 1, rng.randrange(200_000)]) for _ in range(rng.randrange(most + 1)))


def random_row(rng: random.Random) -> LaneRows:
    slot, start = rng.randrange(2**16), rng.choice([0, 2**63 - 1, rng.randrange(1 << 20)])
    draw = random_draw(rng) if rng.random() < 0.7 else None
    if rng.random() < 0.2:  # its token is the lane's draw of the round before
        return LaneRows(slot, (0,), start, draw, prior_draw=True)
    if rng.random() < 0.2:  # a prompt pass whose every row gives logits
        most = rng.choice([0, 1, 20, 254])
        return LaneRows(slot, random_ids(rng, 12), start, draw, (), rng.randrange(16), prompt_logprobs=most)
    return LaneRows(slot, random_ids(rng, 12), start, draw, random_ids(rng, 4), rng.randrange(16))


def random_masks(rng: random.Random, row: LaneRows, length: int) -> LaneRows:
    """The row with a guide mask of `length` bytes at each draw row, where it draws and a coin says so."""
    if row.draw is None or row.prior_draw or rng.random() < 0.5:
        return row
    masks = tuple(rng.randbytes(length) for _ in range(len(row.drafts) + 1))
    return replace(row, guide_masks=masks)


def random_plan(rng: random.Random) -> RoundPlan:
    mask_length = rng.choice([1, 3, 512])
    rows = tuple(random_masks(rng, random_row(rng), mask_length) for _ in range(rng.randrange(9)))
    ops = tuple(
        LaneOp(
            rng.choice(list(LaneOpCode)),
            rng.randrange(2**16),
            rng.choice([0, 2**63 - 1, rng.randrange(1000)]),
            rng.choice([0, 2**32 - 1, rng.randrange(300)]),
        )
        for _ in range(rng.randrange(4))
    )
    return RoundPlan(
        kind=rng.choice(list(RoundKind)),
        allocate=tuple(rng.randrange(2**16) for _ in range(rng.randrange(4))),
        free=tuple(rng.randrange(2**16) for _ in range(rng.randrange(4))),
        rows=rows,
        ops=ops,
    )


SAMPLE = RoundPlan(
    allocate=(3,),
    free=(1, 2),
    rows=(
        LaneRows(3, (11, 12, 13), 0, None),
        LaneRows(0, (7,), 40, DrawSpec(0.7, 20, 0.95, 0.05, 1234), drafts=(8, 9), draft_depth=3),
    ),
    ops=(LaneOp(LaneOpCode.KEEP, 0, 99, after=3),),
)
EXAMPLES = [
    SAMPLE,
    RoundPlan(),
    RoundPlan(kind=RoundKind.STOP),
    *(random_plan(random.Random(seed)) for seed in range(5)),
]


def test_random_plans_round_trip_exactly() -> None:
    rng = random.Random(2024)
    for _ in range(1000):
        plan = random_plan(rng)
        data = encode_header(plan)
        assert decode_header(data) == plan
        assert decode_header(bytearray(data)) == plan
        assert decode_header(memoryview(data)) == plan


def test_the_byte_layout_is_pinned() -> None:
    body = b"".join(
        (
            COUNTS.pack(1, 1, 2, 2, 1),  # kind ROUND; 1 allocate, 2 free, 2 rows, 1 lane op
            struct.pack("<H", 3),  # allocate
            struct.pack("<2H", 1, 2),  # free
            struct.pack("<2H", 3, 0),  # row slots
            struct.pack("<2q", 0, 40),  # row starts
            struct.pack("<2I", 3, 1),  # token counts
            struct.pack("<2I", 0, 2),  # draft counts
            struct.pack("<2B", 0, 1),  # draw flags
            struct.pack("<2B", 0, 3),  # draft depths
            struct.pack("<4i", 11, 12, 13, 7),  # token ids, row after row
            struct.pack("<2i", 8, 9),  # draft ids
            struct.pack("<dIddq", 0.7, 20, 0.95, 0.05, 1234),  # one drawing row: temperature, top_k, top_p, min_p, seed
            struct.pack("<I", 0),  # its logit bias's count (its ids and biases follow: none)
            struct.pack("<B", 0),  # its logprobs count: 0 for none, else 1 + how many of the most likely
            struct.pack("<qI", 0, 0),  # where its suppression ends, and how many ids it suppresses (their ids: none)
            struct.pack("<3dq", 1.0, 0.0, 0.0, 0),  # its repetition, frequency and presence penalties; output start
            struct.pack("<I", 0),  # how many ids it allows (their ids: none, so any)
            struct.pack("<BHqI", 1, 0, 99, 3),  # lane op: KEEP slot 0 handle 99, after 3 of its rows
            struct.pack("<2B", 0, 0),  # prior-draw flags
            struct.pack("<2B", 0, 0),  # prompt-logprob counts: 0 for none, else 1 + how many of the most likely
            struct.pack("<2BI", 0, 0, 0),  # guide mask counts, the length they share (0: none), then the masks
        )
    )
    assert encode_header(SAMPLE) == seal(body)
    assert decode_header(seal(body)) == SAMPLE
    prior = RoundPlan(rows=(LaneRows(5, (0,), 41, SAMPLE.rows[1].draw, prior_draw=True),))
    draw = struct.pack("<dIddqIBqI3dqI", 0.7, 20, 0.95, 0.05, 1234, 0, 0, 0, 0, 1.0, 0.0, 0.0, 0, 0)
    tail = draw + struct.pack("<2B", 1, 0) + struct.pack("<BI", 0, 0)  # the draw, prior-draw, prompt-logprob, masks
    assert encode_header(prior).endswith(tail) and decode_header(encode_header(prior)) == prior
    draws = (
        DrawSpec(0.0, 0, 1.0, 0.0, 5, ((9, -100.0), (4, 2.5)), logprobs=0, suppress_ids=(2, 3), suppress_before=40),
        DrawSpec(
            1.0,
            0,
            1.0,
            0.0,
            6,
            ((7, 0.25),),
            logprobs=20,
            repetition_penalty=1.25,
            presence_penalty=-0.5,
            frequency_penalty=2.0,
            output_from=17,
            allowed_ids=(3, 11),
        ),
    )
    biased = RoundPlan(rows=tuple(LaneRows(slot, (1,), 0, draw) for slot, draw in enumerate(draws)))
    columns = struct.pack("<2I", 2, 1) + struct.pack("<3i", 9, 4, 7) + struct.pack("<3d", -100.0, 2.5, 0.25)
    columns += struct.pack("<2B", 1, 21)  # the logprobs counts
    columns += struct.pack("<2q2I2i", 40, 0, 2, 0, 2, 3)  # suppression ends, suppressed id counts, suppressed ids
    columns += struct.pack("<6d2q", 1.0, 0.0, 0.0, 1.25, 2.0, -0.5, 0, 17)  # penalties draw by draw, output starts
    columns += struct.pack("<2I2i", 0, 2, 3, 11)  # allowed id counts, allowed ids
    assert columns + struct.pack("<2B", 0, 0) in encode_header(biased)  # counts, then ids, then biases, draw by draw
    assert decode_header(encode_header(biased)) == biased
    guided = RoundPlan(rows=(LaneRows(0, (1,), 0, draws[0], (5,), guide_masks=(b"\x01\x80", b"\xff\x00")),))
    assert encode_header(guided).endswith(struct.pack("<BI", 2, 2) + b"\x01\x80\xff\x00")
    assert decode_header(encode_header(guided)) == guided


@pytest.mark.parametrize(
    ("masks", "drafts", "draws", "fault"),
    [
        ((b"\x01",), (5,), True, "1 guide masks, but it draws at 2 rows"),
        ((b"\x01", b"\x01"), (), True, "2 guide masks, but it draws at 1 rows"),
        ((b"\x01",), (), False, "1 guide masks, but it draws at 0 rows"),
        ((b"\x01", b"\x01\x02"), (5,), True, "share one length above 0, got lengths [1, 2]"),
        ((b"",), (), True, "share one length above 0, got lengths [0]"),
    ],
)
def test_guide_masks_that_do_not_fit_their_draw_rows_are_refused(
    masks: tuple[bytes, ...], drafts: tuple[int, ...], draws: bool, fault: str
) -> None:
    draw = SAMPLE.rows[1].draw if draws else None
    plan = RoundPlan(rows=(LaneRows(0, (1,), 0, draw, drafts, guide_masks=masks),))
    with pytest.raises(HeaderError, match=re.escape(fault)):
        encode_header(plan)


def test_a_decoded_header_whose_masks_do_not_fit_its_rows_is_refused() -> None:
    plan = RoundPlan(rows=(LaneRows(0, (1,), 0, SAMPLE.rows[1].draw, (5,), guide_masks=(b"\x01", b"\x02")),))
    data = bytearray(encode_header(plan))
    body = bytes(data[PREFIX.size :])
    at = body.rindex(struct.pack("<BI", 2, 1))
    forged = body[:at] + struct.pack("<BI", 1, 2) + body[at + 5 :]  # one mask of two bytes: the same blob
    with pytest.raises(HeaderError, match=re.escape("1 guide masks, but it draws at 2 rows")):
        decode_header(seal(forged))


@pytest.mark.parametrize("plan", EXAMPLES, ids=range(len(EXAMPLES)))
def test_every_truncation_and_any_trailing_byte_is_refused(plan: RoundPlan) -> None:
    data = encode_header(plan)
    for end in range(len(data)):
        with pytest.raises(HeaderError, match="truncated"):
            decode_header(data[:end])
    with pytest.raises(HeaderError, match="1 trailing bytes"):
        decode_header(data + b"\0")


@pytest.mark.parametrize("plan", EXAMPLES, ids=range(len(EXAMPLES)))
def test_every_single_byte_corruption_is_refused(plan: RoundPlan) -> None:
    data = encode_header(plan)
    rng = random.Random(len(data))
    for position in range(len(data)):
        for flip in {1, 0x80, 0xFF, rng.randrange(1, 256)}:
            corrupt = bytearray(data)
            corrupt[position] ^= flip
            with pytest.raises(HeaderError):
                decode_header(bytes(corrupt))


def test_random_bytes_are_refused() -> None:
    rng = random.Random(7)
    for _ in range(5000):
        data = rng.randbytes(rng.randrange(80))
        if rng.random() < 0.5:
            data = b"FNRH\x01\x00" + data
        with pytest.raises(HeaderError):
            decode_header(data)


def structural_offsets(plan: RoundPlan) -> set[int]:
    """Offsets of the bytes that give the layout: section counts, per-row token and draft counts, draw flags, guide mask
    counts and length."""
    n = len(plan.rows)
    counts = PREFIX.size + 1
    rows = counts + 16 + 2 * (len(plan.allocate) + len(plan.free)) + 10 * n  # past the slots and starts columns
    masks = len(encode_header(plan)) - sum(map(len, (mask for row in plan.rows for mask in row.guide_masks))) - 4 - n
    return set(range(counts, counts + 16)) | set(range(rows, rows + 9 * n)) | set(range(masks, masks + n + 4))


@pytest.mark.parametrize("plan", EXAMPLES, ids=range(len(EXAMPLES)))
def test_resealed_corruptions_never_decode_to_a_guess(plan: RoundPlan) -> None:
    """With the checksum recomputed, a corrupt body either is refused or decodes to the plan it exactly encodes."""
    data = encode_header(plan)
    structural = structural_offsets(plan)
    rng = random.Random(len(data))
    for position in range(PREFIX.size, len(data)):
        for flip in {1, 0x80, 0xFF, rng.randrange(1, 256)}:
            body = bytearray(data[PREFIX.size :])
            body[position - PREFIX.size] ^= flip
            corrupt = seal(bytes(body))
            try:
                decoded = decode_header(corrupt)
            except HeaderError:
                continue
            assert position not in structural, f"a corrupt count or flag at offset {position} was accepted"
            assert encode_header(decoded) == corrupt


def test_resealed_random_bodies_are_refused_or_exact() -> None:
    rng = random.Random(11)
    accepted = 0
    for _ in range(5000):
        counts = [rng.randrange(3) for _ in range(4)]
        body = COUNTS.pack(rng.choice([0, 1, 2, 3]), *counts)
        size = 2 * counts[0] + 2 * counts[1] + 21 * counts[2] + 15 * counts[3] + rng.randrange(-2, 3)
        body += rng.randbytes(max(0, size)) + bytes(4)  # the guide masks' length: 0, as a header without masks has
        try:
            plan = decode_header(seal(body))
        except HeaderError:
            continue
        accepted += 1
        assert encode_header(plan) == seal(body)
    assert accepted > 20


def body_of(plan: RoundPlan) -> bytearray:
    return bytearray(encode_header(plan)[PREFIX.size :])


def test_faults_are_named() -> None:
    sample = encode_header(SAMPLE)
    body = body_of(SAMPLE)
    cases: list[tuple[bytes, str]] = [
        (b"XXXX" + sample[4:], "bad magic b'XXXX'"),
        (seal(bytes(body), version=2), "unknown header version 2"),
        (sample[:-1], f"truncated header: {len(sample) - 1} of its declared {len(sample)} bytes"),
        (sample[:5], "truncated header: 5 bytes"),
        (sample + b"xy", "2 trailing bytes"),
        (sample[:10] + b"\0\0\0\0" + sample[14:], "checksum mismatch"),
        (PREFIX.pack(b"FNRH", 12, 20, 0) + bytes(20), "declared length 20 is shorter than the fixed part"),
        (seal(bytes([9]) + bytes(body[1:])), "unknown round kind 9"),
        (seal(COUNTS.pack(1, 1000, 0, 0, 0)), "allocate slots: 1000 values need 2000 bytes but 0 remain"),
        (seal(COUNTS.pack(1, 0, 0, 0, 0) + bytes(5)), "1 trailing bytes inside the header's body"),
    ]
    tail = 2 + 4  # the two rows' guide mask counts and the masks' length, after every column below
    flags = 17 + 2 * 3 + 2 * 2 + 8 * 2 + 4 * 2 + 4 * 2  # offset of the draw flags in the body
    corrupt = body.copy()
    corrupt[flags + 1] = 2
    cases.append((seal(bytes(corrupt)), "draw flag 2 is neither 0 nor 1"))
    tokens = flags + 2 + 2  # past the draw flags and the draft depths
    corrupt = body.copy()
    corrupt[tokens : tokens + 4] = struct.pack("<i", -5)
    cases.append((seal(bytes(corrupt)), "token ids: -5 is negative"))
    corrupt = body.copy()
    corrupt[-19 - tail] = 7  # before the lane op's slot, argument and row offset, and the two rows' two flags
    cases.append((seal(bytes(corrupt)), "unknown lane op code 7"))
    corrupt = body.copy()
    corrupt[-3 - tail] = 2
    cases.append((seal(bytes(corrupt)), "prior-draw flag 2 is neither 0 nor 1"))
    corrupt = body.copy()
    corrupt[-1 - tail] = 1  # row 1 verifies drafts
    cases.append((seal(bytes(corrupt)), "row 1: a row with the prompt's logprobs takes no prior draw and no drafts"))
    corrupt = body.copy()
    corrupt[-4 - tail] = 1  # row 0 holds three tokens
    cases.append((seal(bytes(corrupt)), "row 0: a prior-draw row is one token 0 with no drafts and no draft depth"))
    temperature = tokens + 4 * 4 + 4 * 2
    for value, message in [
        (math.nan, "temperature nan is not a finite number >= 0"),
        (-0.5, "temperature -0.5 is not a finite number >= 0"),
        (math.inf, "temperature inf is not a finite number >= 0"),
    ]:
        corrupt = body.copy()
        corrupt[temperature : temperature + 8] = struct.pack("<d", value)
        cases.append((seal(bytes(corrupt)), message))
    corrupt = body.copy()
    corrupt[temperature + 12 : temperature + 20] = struct.pack("<d", 1.5)
    cases.append((seal(bytes(corrupt)), "top_p 1.5 is not in"))
    biased = body_of(RoundPlan(rows=(LaneRows(0, (1,), 0, DrawSpec(1.0, 0, 1.0, 0.0, 1, ((3, 1.0), (4, 2.0)))),)))
    ids, biases = (
        len(biased) - 5 - 51 - 16 - 8,
        len(biased) - 5 - 51 - 16,
    )  # before the logprobs, suppression and penalties
    penalties = (
        len(biased) - 5 - 2 - 4 - 8 - 24
    )  # (5: its mask count and length) before the output start, the allowed id count and the row's two flags
    for at, value, message in [
        (ids + 4, struct.pack("<i", 3), "a logit bias gives one token id twice"),
        (ids, struct.pack("<i", -3), "logit bias ids: -3 is negative"),
        (biases + 8, struct.pack("<d", math.inf), "logit bias inf is not a finite number"),
        (biases, struct.pack("<d", math.nan), "logit bias nan is not a finite number"),
        (penalties, struct.pack("<d", 0.0), "repetition penalty 0.0 is not a finite number > 0"),
        (penalties, struct.pack("<d", -1.0), "repetition penalty -1.0 is not a finite number > 0"),
        (penalties, struct.pack("<d", math.nan), "repetition penalty nan is not a finite number > 0"),
        (penalties + 8, struct.pack("<d", math.inf), "penalty inf is not a finite number"),
        (penalties + 16, struct.pack("<d", math.nan), "penalty nan is not a finite number"),
        (penalties + 24, struct.pack("<q", -4), "output starts: -4 is negative"),
    ]:
        corrupt = biased.copy()
        corrupt[at : at + len(value)] = value
        cases.append((seal(bytes(corrupt)), message))
    allowed = body_of(RoundPlan(rows=(LaneRows(0, (1,), 0, DrawSpec(1.0, 0, 1.0, 0.0, 1, allowed_ids=(3, 5))),)))
    allowed[-11:-7] = struct.pack(
        "<i", 3
    )  # the second allowed id, before the row's two flags and its masks' count and length
    cases.append((seal(bytes(allowed)), "draw 0: its allowed ids give one token id twice"))
    masked = body_of(RoundPlan(rows=(LaneRows(0, (1,), 0, DrawSpec(1.0, 0, 1.0, 0.0, 1), guide_masks=(b"\x01",)),)))
    masked[-5:] = struct.pack("<I", 0)  # the masks' length 0, and the one mask's byte gone with it
    cases.append((seal(bytes(masked)), "share one length above 0, got lengths [0]"))
    for data, message in cases:
        with pytest.raises(HeaderError) as caught:
            decode_header(data)
        assert message in str(caught.value)


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (RoundPlan(allocate=(70_000,)), "cannot encode allocate slots"),
        (RoundPlan(rows=(LaneRows(0, (-1,), 0, None),)), "token ids: -1 is negative"),
        (RoundPlan(rows=(LaneRows(0, (2**31,), 0, None),)), "cannot encode token ids"),
        (RoundPlan(rows=(LaneRows(0, (), 2**63, None),)), "cannot encode row starts"),
        (RoundPlan(rows=(LaneRows(0, (1,), 0, DrawSpec(math.nan, 0, 1.0, 0.0, 1)),)), "temperature nan"),
        (RoundPlan(rows=(LaneRows(0, (1,), 0, DrawSpec(1.0, 0, 1.0, 2.0, 1)),)), "min_p 2.0 is not in"),
        (RoundPlan(rows=(LaneRows(0, (1,), 0, DrawSpec(1.0, -1, 1.0, 0.0, 1)),)), "top_k values: -1 is negative"),
        (RoundPlan(rows=(LaneRows(0, (1,), 0, DrawSpec(1.0, 0, 1.0, 0.0, 1, ((2, 1.0), (2, 3.0)))),)), "id twice"),
        (RoundPlan(rows=(LaneRows(0, (1,), 0, DrawSpec(1.0, 0, 1.0, 0.0, 1, ((2, math.nan),))),)), "bias nan"),
        (RoundPlan(rows=(LaneRows(0, (1,), 0, DrawSpec(1.0, 0, 1.0, 0.0, 1, ((-2, 1.0),))),)), "ids: -2 is negative"),
        (RoundPlan(rows=(LaneRows(0, (1,), 0, DrawSpec(1.0, 0, 1.0, 0.0, 1, logprobs=255)),)), "logprobs counts"),
        (RoundPlan(rows=(LaneRows(0, (1,), 0, DrawSpec(1.0, 0, 1.0, 0.0, 1, logprobs=-1)),)), "logprobs counts"),
        (RoundPlan(rows=(LaneRows(0, (1,), 0, DrawSpec(1.0, 0, 1.0, 0.0, 1, repetition_penalty=0.0)),)), "> 0"),
        (RoundPlan(rows=(LaneRows(0, (1,), 0, DrawSpec(1.0, 0, 1.0, 0.0, 1, presence_penalty=math.inf)),)), "inf"),
        (RoundPlan(rows=(LaneRows(0, (1,), 0, DrawSpec(1.0, 0, 1.0, 0.0, 1, output_from=-1)),)), "output starts"),
        (RoundPlan(rows=(LaneRows(0, (1,), 0, DrawSpec(1.0, 0, 1.0, 0.0, 1, allowed_ids=(4, 4))),)), "id twice"),
        (RoundPlan(rows=(LaneRows(0, (1,), 0, DrawSpec(1.0, 0, 1.0, 0.0, 1, allowed_ids=(-4,))),)), "allowed ids"),
        (RoundPlan(ops=(LaneOp(7, 0, 0),)), "unknown lane op code 7"),  # type: ignore[arg-type]
        (RoundPlan(kind=5), "cannot encode the round kind"),  # type: ignore[arg-type]
        (RoundPlan(rows=(LaneRows(0, (7,), 0, None, prior_draw=True),)), "row 0: a prior-draw row is one token 0"),
        (RoundPlan(rows=(LaneRows(0, (0,), 0, None, (3,), prior_draw=True),)), "a prior-draw row is one token 0"),
        (RoundPlan(rows=(LaneRows(0, (0,), 0, None, (), 2, prior_draw=True),)), "a prior-draw row is one token 0"),
        (RoundPlan(rows=(LaneRows(0, (1,), 0, None, (3,), prompt_logprobs=0),)), "no prior draw and no drafts"),
        (RoundPlan(rows=(LaneRows(0, (0,), 0, None, prior_draw=True, prompt_logprobs=2),)), "no prior draw"),
        (RoundPlan(rows=(LaneRows(0, (1,), 0, None, prompt_logprobs=255),)), "prompt-logprob count 255"),
    ],
)
def test_the_encoder_refuses_what_the_format_cannot_carry(plan: RoundPlan, message: str) -> None:
    with pytest.raises(HeaderError, match=message.replace("(", r"\(")):
        encode_header(plan)
