"""Value arithmetic without a framework: dtype casts and the transcendental functions of the value
transforms, on numpy arrays that hold each dtype as `DType.storage` (bfloat16 and float8 as the
unsigned integers of their bits).

The rule is PyTorch's, bit for bit, so that a conversion made here writes the bytes the torch
path wrote (tests/convert/test_numpy_path.py proves it against torch):

* float32 -> bfloat16 / float16 rounds to nearest, ties to even; overflow goes to inf, subnormals
  are kept (float16's through numpy's IEEE cast, bfloat16's by integer arithmetic on the bits).
* float32 -> float8_e4m3fn rounds to nearest, ties to even, subnormals kept, and saturates:
  every magnitude above 448 (the largest finite value), inf included, becomes +-448, and NaN stays
  NaN (0x7F with its sign): torch 2.13's CPU cast, measured on every bfloat16 and float16 and on
  the float32 values around every rounding boundary (tests/export/test_fp8_numerics.py).  Older
  c10 code made overflow NaN instead; quantizers clamp to +-448 first anyway (export/fp8.py, as
  compressed-tensors does), so only a NaN input could tell the two rules apart.
* NaN follows what torch's CPU kernels do, which differs per pair (measured on torch 2.13,
  AVX-512): float32 -> bfloat16 gives 0xFFFF for every NaN; float32 <-> float16 keep the sign and
  the payload's top bits and set the quiet bit (the F16C instructions); float16 or float8 ->
  bfloat16 gives 0x7FC0; bfloat16 -> float32 is exact.  torch's float16 -> float32 is not even
  consistent with itself: the last `n % 8` elements of a run (its scalar loop) become 0x7FFFFFFF;
  we follow the vector loop.  Only NaN payloads are concerned, never a number.
* exp and log are rounded correctly (computed in float64, rounded once).  torch's float32 exp
  (MKL's or Sleef's, chosen by CPU) is not: it differs from the correctly rounded value by one ulp
  in about 1% of inputs, and from machine to machine, so no framework-free code can match it bit
  for bit.  Only A = -exp(A_log) (and its inverse, when shards are the source) is affected; the
  test allows one ulp there and nowhere else.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .dtypes import BFLOAT16, FLOAT8_E4M3, FLOAT8_E5M2, FLOAT16, FLOAT32, FLOAT64, DType, as_dtype

_NAN_F32_TO_BF16 = np.uint16(0xFFFF)
_NAN_NARROW_TO_BF16 = np.uint16(0x7FC0)
# float32 bit patterns of float8_e4m3fn rounding: 2^-6 (the smallest normal), and 2^14, whose float32 ulp
# is e4m3fn's subnormal step 2^-9.
_F8E4M3_MIN_NORMAL = np.uint32(121 << 23)
_F8E4M3_DENORM_MAGIC = np.uint32(141 << 23)


def _f8_table(exp_bits: int, man_bits: int, finite_nan: bool) -> np.ndarray:
    """float32 value of every float8 bit pattern (e4m3fn: no inf, 0x7F/0xFF are NaN)."""
    bias = 2 ** (exp_bits - 1) - 1
    out = np.empty(256, np.float32)
    for b in range(256):
        sign = -1.0 if b & 0x80 else 1.0
        e, m = (b >> man_bits) & (2**exp_bits - 1), b & (2**man_bits - 1)
        if finite_nan and e == 2**exp_bits - 1 and m == 2**man_bits - 1:
            v = float("nan")  # torch's bits: sign | 0x7FF00000
        elif not finite_nan and e == 2**exp_bits - 1:
            v = float("inf") * sign if m == 0 else float("nan")  # torch: the quieted float16 payload
        elif e == 0:
            v = sign * m * 2.0 ** (1 - bias - man_bits)
        else:
            v = sign * (1 + m / 2**man_bits) * 2.0 ** (e - bias)
        out[b] = v
        if v != v:
            if finite_nan:
                out.view(np.uint32)[b] = (0x80000000 if b & 0x80 else 0) | 0x7FF00000
            else:  # e5m2 is the top byte of a float16: widened as that float16, quieted
                half = np.array([(b << 8) | 0x200], np.uint16).view(np.float16)
                out[b] = half.astype(np.float32)[0]
    return out


_F8 = {FLOAT8_E4M3: _f8_table(4, 3, True), FLOAT8_E5M2: _f8_table(5, 2, False)}


def to_float32(x: np.ndarray, dtype: DType) -> np.ndarray:
    """Values of `dtype` (held as its storage) as float32, as torch's `.float()` makes them."""
    if dtype == FLOAT32:
        return x
    if dtype == BFLOAT16:  # the top half of a float32: exact, payloads included
        return (x.astype(np.uint32) << 16).view(np.float32)
    if dtype == FLOAT16:  # F16C's rule for NaN (torch's vector loop; its scalar tail differs)
        out = x.astype(np.float32)
        nan = np.isnan(out)
        if nan.any():  # numpy keeps a signalling NaN signalling; the instruction quiets it
            out.view(np.uint32)[nan] |= np.uint32(0x00400000)
        return out
    if dtype in _F8:
        return _F8[dtype][x]
    if dtype == FLOAT64:
        with np.errstate(over="ignore"):
            return x.astype(np.float32)
    raise ValueError(f"no float32 view of {dtype}")


def from_float32(x: np.ndarray, dtype: DType) -> np.ndarray:
    """float32 values rounded to `dtype` (nearest, ties to even), held as its storage."""
    x = np.ascontiguousarray(x, np.float32)
    if dtype == FLOAT32:
        return x
    if dtype == BFLOAT16:
        bits = x.view(np.uint32)
        # Add half an ulp of bfloat16 minus one, plus the lowest kept bit: ties go to even.
        # A finite value that rounds past the largest bfloat16 lands on inf's bits, as it must.
        out = ((bits + (np.uint32(0x7FFF) + ((bits >> 16) & 1))) >> 16).astype(np.uint16)
        nan = np.isnan(x)
        if nan.any():
            out[nan] = _NAN_F32_TO_BF16
        return out
    if dtype == FLOAT16:
        with np.errstate(over="ignore"):
            out = x.astype(np.float16)
        nan = np.isnan(x)
        if nan.any():  # F16C: sign, quiet bit, the payload's top ten bits
            bits = x.view(np.uint32)[nan]
            out.view(np.uint16)[nan] = (((bits >> 16) & 0x8000) | 0x7E00 | ((bits >> 13) & 0x3FF)).astype(np.uint16)
        return out
    if dtype == FLOAT64:
        return x.astype(np.float64)
    if dtype == FLOAT8_E4M3:
        return float8_e4m3fn_bits(x)
    raise NotImplementedError(f"rounding to {dtype} has no numpy path")


Work = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # three uint32 buffers and a bool one, >= x.size each


def float8_e4m3fn_bits(x: np.ndarray, work: Work | None = None) -> np.ndarray:
    """torch's `.to(float8_e4m3fn)` of float32 values: round to nearest even on the bits, saturate beyond 448.
    Branch-free (every element takes the normal path, the few subnormal and NaN ones are replaced after: boolean
    gathers cost more than the arithmetic), in the caller's `work` buffers when given (fresh temporaries of
    millions of elements cost as much system time in page faults as the arithmetic costs user time)."""
    n = x.size
    bits = np.ascontiguousarray(x, np.float32).reshape(-1).view(np.uint32)
    mag, r, t, m = (w[:n] for w in work) if work else (*(np.empty(n, np.uint32) for _ in range(3)), np.empty(n, bool))
    np.bitwise_and(bits, np.uint32(0x7FFFFFFF), out=mag)
    # Normal results: rebias the exponent (127 -> 7), add half an e4m3fn ulp minus one plus the kept mantissa's
    # lowest bit (ties to even), keep the top bits; magnitudes above 448, inf included, saturate to 0x7E.  The
    # subtraction wraps for magnitudes below 2^-6, which the subnormal path replaces.
    np.add(mag, np.uint32((0x7FFFF - (120 << 23)) % 2**32), out=r)
    np.right_shift(mag, np.uint32(20), out=t)
    np.bitwise_and(t, np.uint32(1), out=t)
    np.add(r, t, out=r)
    np.right_shift(r, np.uint32(20), out=r)
    np.minimum(r, np.uint32(0x7E), out=r)
    # Subnormal results: a float32 add of 2^14 rounds the value to a multiple of 2^-9 (ties to even, IEEE),
    # leaving the e4m3fn bits in the low mantissa.
    np.less(mag, _F8E4M3_MIN_NORMAL, out=m)
    if m.any():
        np.add(mag.view(np.float32), _F8E4M3_DENORM_MAGIC.view(np.float32), out=t.view(np.float32))
        np.subtract(t, _F8E4M3_DENORM_MAGIC, out=t)
        np.copyto(r, t, where=m)
    np.greater(mag, np.uint32(0x7F800000), out=m)
    if m.any():
        r[m] = 0x7F
    np.right_shift(bits, np.uint32(24), out=t)
    np.bitwise_and(t, np.uint32(0x80), out=t)
    np.bitwise_or(r, t, out=r)
    return r.astype(np.uint8).reshape(x.shape)


def round_in_place(x: np.ndarray, dtype: DType, work: np.ndarray | None = None) -> np.ndarray:
    """float32 values rounded to `dtype` and left in float32 (`x.to(dtype).float()`), in place: what torch computes
    for an operation on `dtype` tensors (a float32 result rounded once).  `work`: a uint32 buffer >= x.size."""
    if dtype == FLOAT32:
        return x
    if dtype == BFLOAT16 and not np.isnan(x).any():  # from_float32's rounding, kept in the float32's top half
        bits = x.reshape(-1).view(np.uint32)
        t = work[: x.size] if work is not None else np.empty(x.size, np.uint32)
        np.right_shift(bits, np.uint32(16), out=t)
        np.bitwise_and(t, np.uint32(1), out=t)
        np.add(t, np.uint32(0x7FFF), out=t)
        np.add(bits, t, out=bits)
        np.bitwise_and(bits, np.uint32(0xFFFF0000), out=bits)
        return x
    x[...] = to_float32(from_float32(x, dtype), dtype)
    return x


def cast(x: np.ndarray, src: DType, dst: DType) -> np.ndarray:
    """torch's `.to(dst)` of values of `src`."""
    if src == dst:
        return x
    if dst == BFLOAT16 and src in (FLOAT16, FLOAT8_E4M3, FLOAT8_E5M2):
        wide = to_float32(x, src)  # exact widening: one rounding
        out = from_float32(wide, BFLOAT16)
        out[np.isnan(wide)] = _NAN_NARROW_TO_BF16
        return out
    if src == FLOAT64 and dst in (BFLOAT16, FLOAT16):
        # torch rounds a double once to the narrow type; through float32 would round twice.
        raise NotImplementedError(f"{src} -> {dst} has no numpy path")
    return from_float32(to_float32(x, src), dst)


def exp_float32(x: np.ndarray) -> np.ndarray:
    """exp of float32 values, rounded correctly to float32 (see the module docstring)."""
    with np.errstate(over="ignore", under="ignore"):
        return np.exp(x.astype(np.float64)).astype(np.float32)


def log_float32(x: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.log(x.astype(np.float64)).astype(np.float32)


def nonzero_count(x: np.ndarray, dtype: DType) -> int:
    """How many values are not zero (a float's -0.0 is zero; NaN is not)."""
    if dtype.storage.startswith("uint") and dtype.is_floating_point:
        sign = np.array(1 << (8 * dtype.itemsize - 1), x.dtype)
        return int(np.count_nonzero(x & ~sign))
    return int(np.count_nonzero(x))


# ---- the frontier with torch: for the commands that run the model, and the tests ---------------
def to_torch(x: np.ndarray, dtype: DType) -> Any:
    """A torch tensor of the same values (shares memory where it can)."""
    import torch

    dtype = as_dtype(dtype)
    if dtype.storage != dtype.name and dtype.kind == "float":  # bits held as unsigned integers
        signed = {1: np.int8, 2: np.int16}[dtype.itemsize]
        return torch.from_numpy(np.ascontiguousarray(x).view(signed)).view(dtype.torch)
    return torch.from_numpy(np.ascontiguousarray(x))


def from_torch(t: Any) -> tuple[np.ndarray, DType]:
    """A CPU torch tensor's values as (storage array, dtype)."""
    dtype = as_dtype(t.dtype)
    t = t.detach().contiguous().cpu()
    if dtype.storage != dtype.name and dtype.kind == "float":
        import torch

        signed = {1: torch.int8, 2: torch.int16}[dtype.itemsize]
        return t.view(signed).numpy().view(dtype.np), dtype
    return t.numpy(), dtype
