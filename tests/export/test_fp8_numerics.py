"""float32 -> float8_e4m3fn in numpy (numerics.py) against torch's own cast, the rule compressed-tensors' quantizer
runs (`tensor.to(torch.float8_e4m3fn)` after clamping): round to nearest, ties to even, subnormals kept, magnitudes
above 448 (inf too) saturated to +-448, NaN kept with its sign.

Every bfloat16 and every float16 bit pattern (all 65536 of each), the float32 values on, between and one ulp either
side of every midpoint of two e4m3fn neighbours, and random float32 bit patterns.  Shown to fail (every test but
the last, each time): with the ties-to-even term dropped (`np.add(r, t, out=r)` in `numerics.float8_e4m3fn_bits`)
the ties differ (bfloat16 0x3c98: ours 0x09, torch 0x0a); with overflow mapped to NaN (the older c10 rule, a
saturation at 0x7F) every magnitude above 448 does (bfloat16 0x43e1: ours 0x7f, torch 0x7e).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from plamo2_tools import numerics
from plamo2_tools.dtypes import BFLOAT16, FLOAT8_E4M3, FLOAT16, FLOAT32, DType


def torch_to_fp8(x: np.ndarray, src: DType) -> np.ndarray:
    return numerics.from_torch(numerics.to_torch(x, src).to(torch.float8_e4m3fn))[0]


def differing(ours: np.ndarray, theirs: np.ndarray, x: np.ndarray) -> list[str]:
    bad = np.nonzero(ours != theirs)[0]
    return [f"{x.view(f'u{x.dtype.itemsize}')[i]:#x}: ours {ours[i]:#04x}, torch {theirs[i]:#04x}" for i in bad[:5]]


@pytest.mark.parametrize("src", [BFLOAT16, FLOAT16], ids=str)
def test_every_16_bit_float_rounds_to_e4m3fn_as_torch_does(src: DType) -> None:
    x = np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(src.np)
    ours, theirs = numerics.cast(x, src, FLOAT8_E4M3), torch_to_fp8(x, src)
    assert ours.dtype == np.uint8
    assert not differing(ours, theirs, x), differing(ours, theirs, x)


def e4m3fn_boundaries() -> np.ndarray:
    """Every finite e4m3fn value, each midpoint between neighbours and the float32 values one ulp either side of
    it (ties and near-ties, in the subnormal range too), both signs, plus overflow, inf and NaN."""
    values = numerics.to_float32(np.arange(256, dtype=np.uint8), FLOAT8_E4M3)
    finite = np.unique(values[np.isfinite(values)])
    mids = ((finite[:-1].astype(np.float64) + finite[1:]) / 2).astype(np.float32)
    up, down = np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf))
    edge = np.float32(
        [448, 448.5, 463.99, 464, 464.01, 479, 480, 1e4, 3.4e38, np.inf, 2.0**-10, 2.0**-12, 1e-45, np.nan]
    )
    out = np.concatenate([finite, mids, up, down, edge])
    return np.concatenate([out, -out])


def test_float32_on_every_rounding_boundary_matches_torch() -> None:
    x = e4m3fn_boundaries()
    ours, theirs = numerics.cast(x, FLOAT32, FLOAT8_E4M3), torch_to_fp8(x, FLOAT32)
    assert not differing(ours, theirs, x), differing(ours, theirs, x)


def test_random_float32_bit_patterns_match_torch() -> None:
    x = np.random.default_rng(31).integers(0, 2**32, 1_000_448, dtype=np.uint64).astype(np.uint32).view(np.float32)
    ours, theirs = numerics.cast(x, FLOAT32, FLOAT8_E4M3), torch_to_fp8(x, FLOAT32)
    assert not differing(ours, theirs, x), differing(ours, theirs, x)


def test_the_rule_stated_independently() -> None:
    """Not torch's word: halfway values keep an even mantissa, overflow saturates, NaN stays NaN."""
    x = np.float32([1.0625, 1.1875, 0.5 + 2**-5, 2.0**-9 * 1.5, 2.0**-9 * 2.5, 1000.0, -np.inf, np.nan])
    assert numerics.cast(x, FLOAT32, FLOAT8_E4M3).tolist() == [0x38, 0x3A, 0x30, 0x02, 0x02, 0x7E, 0xFE, 0x7F]
