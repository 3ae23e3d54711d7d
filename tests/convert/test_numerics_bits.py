"""numerics.py's bit-level helpers against an independent computation, element by element (issue 34, class 3):
every float16 and bfloat16 bit pattern (65,536 each), every float8 pattern, and random float32 patterns.

The oracles share no code with numpy's casts or numerics.py: Python's `struct` (IEEE half and single
precision, rounding half to even, written in C against the standard, not SIMD), integer bit logic written
out here (bfloat16's round to nearest even as a branch on the dropped half, float8 decoded field by field with
`math.ldexp`), and for NaN inputs the rule numerics.py documents, `nan_rule` of test_numpy_path.py (one
statement of it for the whole suite).

Each test was seen to fail on the bug it guards, planted by hand and by bench/mutants.py (the `bits-` mutants):
`nonzero_count`'s sign mask one bit off or dropped, float16's NaN quieted on the wrong bit or not at all, the
bfloat16 rounding bias without its tie bit, float8 NaN or subnormal decoding changed.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
from test_numpy_path import is_nan_bits, nan_rule

from plamo2_tools import numerics
from plamo2_tools.dtypes import (
    BFLOAT16,
    BOOL,
    FLOAT8_E4M3,
    FLOAT8_E5M2,
    FLOAT16,
    FLOAT32,
    FLOAT64,
    INT8,
    INT16,
    INT32,
    INT64,
    UINT8,
    DType,
)

RNG = np.random.default_rng(34)
ALL16 = np.arange(1 << 16, dtype=np.uint32)  # every 16-bit pattern, as integers


def half_value(bits: int) -> float:
    return struct.unpack("<e", struct.pack("<H", bits))[0]


def single_bits(value: float) -> int:
    """The float32 bit pattern of a value that float32 holds exactly (struct raises if it does not fit)."""
    return struct.unpack("<I", struct.pack("<f", value))[0]


def half_bits_of(value: float) -> int:
    """float32 value -> float16 bits, rounded to nearest even by struct (C's PyFloat_Pack2); overflow is inf."""
    try:
        return struct.unpack("<H", struct.pack("<e", value))[0]
    except OverflowError:
        return 0xFC00 if value < 0 else 0x7C00


def bf16_round(bits32: int) -> int:
    """float32 bits -> bfloat16 bits, nearest even, as a branch on the dropped half (numbers only)."""
    upper, lower = bits32 >> 16, bits32 & 0xFFFF
    if lower > 0x8000 or (lower == 0x8000 and upper & 1):
        upper += 1  # carries into the exponent (and from the largest finite value into inf) as it must
    return upper


def f8_value(b: int, exp_bits: int, man_bits: int, finite_nan: bool) -> float:
    """float8 decoded field by field (e4m3fn: no inf, S.1111.111 is NaN; e5m2: IEEE-like)."""
    sign = -1.0 if b >> 7 else 1.0
    e, m = (b >> man_bits) & ((1 << exp_bits) - 1), b & ((1 << man_bits) - 1)
    bias = (1 << (exp_bits - 1)) - 1
    top = (1 << exp_bits) - 1
    if finite_nan and e == top and m == (1 << man_bits) - 1:
        return math.nan
    if not finite_nan and e == top:
        return sign * math.inf if m == 0 else math.nan
    if e == 0:
        return sign * math.ldexp(m, 1 - bias - man_bits)
    return sign * math.ldexp((1 << man_bits) + m, e - bias - man_bits)


def random_f32_bits(n: int) -> np.ndarray:
    """Random float32 patterns, with every exponent class well represented (zeros, subnormals, ties,
    the edge of float16's and bfloat16's range, inf and NaN)."""
    raw = RNG.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32)
    special = np.array(
        [
            0,
            0x80000000,
            1,
            0x807FFFFF,
            0x3F808000,
            0x3F818000,
            0x477FF000,
            0x477FEFFF,
            0x7F7FFFFF,
            0x7F7F8000,
            0x7F800000,
            0xFF800000,
            0x7FC00000,
            0xFF800001,
            0x33000000,
            0x33000001,
        ],
        dtype=np.uint32,
    )
    # exponents near float16's range (2^-25 .. 2^16) so that its subnormals and overflow are hit often
    near = (RNG.integers(102, 144, n // 2, dtype=np.uint32) << 23) | RNG.integers(0, 1 << 23, n // 2, dtype=np.uint32)
    near |= RNG.integers(0, 2, n // 2, dtype=np.uint32) << 31
    return np.concatenate([special, raw, near])


def mismatches(got: np.ndarray, want: np.ndarray, inputs: np.ndarray) -> list[str]:
    bad = np.flatnonzero(got.astype(np.uint64) != want.astype(np.uint64))
    return [f"{int(inputs[i]):#x}: got {int(got[i]):#x}, want {int(want[i]):#x}" for i in bad[:5]]


# ---- widening: every pattern ---------------------------------------------------------------------
def test_every_float16_widens_to_float32_as_ieee_says() -> None:
    """All 65,536 float16 patterns: numbers exactly (struct), NaNs by the documented rule (quieted,
    sign and payload kept), signalling NaNs included."""
    got = numerics.to_float32(ALL16.astype(np.uint16).view(np.float16), FLOAT16).view(np.uint32)
    nan = is_nan_bits(ALL16.astype(np.uint16), FLOAT16)
    want = np.array(
        [0 if n else single_bits(half_value(b)) for b, n in zip(ALL16.tolist(), nan.tolist(), strict=True)], np.uint32
    )
    want[nan] = nan_rule(ALL16[nan], FLOAT16, FLOAT32)
    assert nan.sum() == 2 * 1023  # the oracle's own classification: 2 signs x 1023 payloads
    assert not mismatches(got, want, ALL16), mismatches(got, want, ALL16)
    quiet = got[nan] & 0x00400000
    assert quiet.all(), "a float16 NaN widened without its quiet bit"


def test_every_bfloat16_widens_to_the_float32_of_its_bits() -> None:
    """All 65,536 bfloat16 patterns: the top half of a float32, NaN payloads included (exact)."""
    got = numerics.to_float32(ALL16.astype(np.uint16), BFLOAT16).view(np.uint32)
    want = np.array([struct.unpack(">I", struct.pack(">H", b) + b"\0\0")[0] for b in ALL16.tolist()], np.uint32)
    assert not mismatches(got, want, ALL16), mismatches(got, want, ALL16)


@pytest.mark.parametrize(("dtype", "fields"), [(FLOAT8_E4M3, (4, 3, True)), (FLOAT8_E5M2, (5, 2, False))], ids=str)
def test_every_float8_widens_to_its_value(dtype: DType, fields: tuple[int, int, bool]) -> None:
    patterns = np.arange(256, dtype=np.uint32)
    got = numerics.to_float32(patterns.astype(np.uint8), dtype).view(np.uint32)
    values = [f8_value(b, *fields) for b in range(256)]
    nan = np.array([v != v for v in values])
    assert (nan == is_nan_bits(patterns.astype(np.uint8), dtype)).all()
    want = np.array([0 if v != v else single_bits(v) for v in values], np.uint32)
    want[nan] = nan_rule(patterns[nan], dtype, FLOAT32)
    assert not mismatches(got, want, patterns), mismatches(got, want, patterns)


# ---- narrowing ---------------------------------------------------------------------------------------
def test_float32_to_float16_rounds_like_struct() -> None:
    """Random float32 patterns (and every float16 value widened: the round trip is the identity)."""
    bits = random_f32_bits(60_000)
    x = bits.view(np.float32)
    got = numerics.from_float32(x, FLOAT16).view(np.uint16).astype(np.uint32)
    nan = is_nan_bits(bits, FLOAT32)
    want = np.array([0 if n else half_bits_of(v) for v, n in zip(x.tolist(), nan.tolist(), strict=True)], np.uint32)
    want[nan] = nan_rule(bits[nan], FLOAT32, FLOAT16)
    assert not mismatches(got, want, bits), mismatches(got, want, bits)

    numbers = ALL16[~is_nan_bits(ALL16.astype(np.uint16), FLOAT16)]
    wide = numerics.to_float32(numbers.astype(np.uint16).view(np.float16), FLOAT16)
    back = numerics.from_float32(wide, FLOAT16).view(np.uint16).astype(np.uint32)
    assert not mismatches(back, numbers, numbers), "float16 -> float32 -> float16 is not the identity"


def test_float32_to_bfloat16_rounds_to_nearest_even() -> None:
    bits = random_f32_bits(100_000)
    got = numerics.from_float32(bits.view(np.float32), BFLOAT16).astype(np.uint32)
    nan = is_nan_bits(bits, FLOAT32)
    want = np.array([bf16_round(b) for b in bits.tolist()], np.uint32)
    want[nan] = nan_rule(bits[nan], FLOAT32, BFLOAT16)
    assert not mismatches(got, want, bits), mismatches(got, want, bits)
    ties = bits[(bits & 0xFFFF) == 0x8000]
    assert len(ties) >= 2, "the sample holds ties of both parities"


@pytest.mark.parametrize("src", [FLOAT16, BFLOAT16], ids=str)
def test_every_16_bit_pattern_casts_to_the_other_16_bit_type(src: DType) -> None:
    """float16 <-> bfloat16 over every pattern: one rounding from the exact float32 value, NaN by the
    rule (float16 NaN -> bfloat16 is 0x7FC0, not the float32 rule's 0xFFFF)."""
    dst = BFLOAT16 if src == FLOAT16 else FLOAT16
    x = ALL16.astype(np.uint16)
    got = numerics.cast(x.view(src.np), src, dst).view(np.uint16).astype(np.uint32)
    nan = is_nan_bits(x, src)
    if src == FLOAT16:
        wide = [single_bits(half_value(b)) for b in ALL16.tolist()]
        want = np.array([bf16_round(w) for w in wide], np.uint32)
    else:
        values = [struct.unpack(">f", struct.pack(">H", b) + b"\0\0")[0] for b in ALL16.tolist()]
        want = np.array([0 if v != v else half_bits_of(v) for v in values], np.uint32)
    want[nan] = nan_rule(ALL16[nan], src, dst)
    assert not mismatches(got, want, ALL16), mismatches(got, want, ALL16)


# ---- counting ----------------------------------------------------------------------------------------
def nonzero_oracle_16(bits: np.ndarray, dtype: DType) -> int:
    """Values that are not zero, decoded one by one (-0.0 is zero, NaN is not)."""
    if dtype == FLOAT16:
        values = [half_value(b) for b in bits.tolist()]
    else:
        values = [struct.unpack(">f", struct.pack(">H", b) + b"\0\0")[0] for b in bits.tolist()]
    return sum(1 for v in values if v != 0.0)


@pytest.mark.parametrize("dtype", [FLOAT16, BFLOAT16], ids=str)
def test_nonzero_count_over_every_16_bit_pattern(dtype: DType) -> None:
    """All patterns at once, each single pattern alone (a count of 0 or 1: every sign and exponent
    bit decides), and random subsets: the count of values a decoder calls non-zero."""
    x = ALL16.astype(np.uint16).view(dtype.np)
    assert numerics.nonzero_count(x, dtype) == nonzero_oracle_16(ALL16, dtype) == (1 << 16) - 2
    singles = [numerics.nonzero_count(x[i : i + 1], dtype) for i in range(1 << 16)]
    want = [1 if v else 0 for v in (half_value(b) if dtype == FLOAT16 else b & 0x7FFF for b in ALL16.tolist())]
    bad = [hex(i) for i in range(1 << 16) if singles[i] != want[i]]
    assert not bad, f"{dtype}: single patterns counted wrong: {bad[:8]}"
    for _ in range(20):
        pick = RNG.choice(ALL16, size=int(RNG.integers(1, 400)))
        sub = pick.astype(np.uint16).view(dtype.np)
        assert numerics.nonzero_count(sub, dtype) == nonzero_oracle_16(pick, dtype)


@pytest.mark.parametrize(("dtype", "fields"), [(FLOAT8_E4M3, (4, 3, True)), (FLOAT8_E5M2, (5, 2, False))], ids=str)
def test_nonzero_count_over_every_float8_pattern(dtype: DType, fields: tuple[int, int, bool]) -> None:
    for b in range(256):
        v = f8_value(b, *fields)
        assert numerics.nonzero_count(np.array([b], np.uint8), dtype) == (v != 0.0), hex(b)
    assert numerics.nonzero_count(np.array([0x80, 0x00, 0x80], np.uint8), dtype) == 0  # zeros of both signs


def test_nonzero_count_of_float32_float64_and_integers() -> None:
    bits = random_f32_bits(20_000)
    x = bits.view(np.float32)
    assert numerics.nonzero_count(x, FLOAT32) == sum(1 for v in x.tolist() if v != 0.0)
    neg_zero = np.array([-0.0, 0.0, -0.0], np.float32)
    assert numerics.nonzero_count(neg_zero, FLOAT32) == 0
    assert numerics.nonzero_count(neg_zero.astype(np.float64), FLOAT64) == 0
    for dtype in (INT8, INT16, INT32, INT64, UINT8):
        info = np.iinfo(dtype.np)
        v = RNG.integers(info.min, info.max, 5000, dtype=dtype.np, endpoint=True)
        v[::7] = 0
        v[1] = info.min  # the integer with only the sign bit set is not zero
        assert numerics.nonzero_count(v, dtype) == sum(1 for t in v.tolist() if t != 0), dtype
    flags = RNG.integers(0, 2, 999).astype(bool)
    assert numerics.nonzero_count(flags, BOOL) == int(sum(flags.tolist()))
