"""Our numpy MLX affine quantizer against `mlx.core.quantize` itself, bit for bit: packed codes,
scales and biases, for float32 / bfloat16 / float16 weights, 2/4/8 bits, group sizes 32/64/128, on
fresh random inputs of several magnitudes and on the groups where the rule has branches (all
zeros, constant, negative-dominated, a single outlier).

Shown to fail: with `rint` replaced by `floor` in the code computation (27 of 34 red), with the
`q0` step (the exact edge) removed (27 red), with the scale's sign flip dropped (28 red);
restored, green.
"""

from __future__ import annotations

import numpy as np
import pytest

from plamo2_tools.dtypes import BFLOAT16, FLOAT16, FLOAT32, DType
from plamo2_tools.errors import UserError
from plamo2_tools.export.mlx_quant import check_params, dequantize, quantize
from plamo2_tools.numerics import from_float32

DTYPES = {"float32": FLOAT32, "bfloat16": BFLOAT16, "float16": FLOAT16}


def weights(rng: np.random.Generator, rows: int, cols: int, group: int) -> np.ndarray:
    """float32 values with every branch of the rule somewhere: magnitudes from 1e-6 to 1e2, a zero
    group, a constant group, a group led by its minimum, a single outlier."""
    scale = rng.choice([1e-6, 1e-2, 1.0, 50.0])  # 1000 x the largest stays finite in float16
    w = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
    w[0, :group] = 0.0
    if rows > 1:
        w[1, :group] = np.float32(0.75)
    if rows > 2:
        w[2, :group] = -np.abs(w[2, :group]) - np.float32(scale)
    if rows > 3:
        w[3, group - 1] = np.float32(1000 * scale)
    return w


def as_mlx(w32: np.ndarray, dtype: DType):  # noqa: ANN201 (an mx.array)
    import mlx.core as mx

    if dtype == BFLOAT16:
        return mx.array(w32).astype(mx.bfloat16)  # MLX rounds to nearest even, as from_float32 does
    if dtype == FLOAT16:
        return mx.array(w32.astype(np.float16))
    return mx.array(w32)


def bits_of(a, dtype: DType) -> np.ndarray:  # noqa: ANN001 (an mx.array)
    """The raw bits of an mx.array of `dtype` (numpy has no bfloat16: view as uint16 in MLX)."""
    import mlx.core as mx

    if dtype == BFLOAT16:
        return np.array(a.view(mx.uint16))
    return np.array(a).view(np.uint16 if dtype == FLOAT16 else np.uint32)


def storage_bits(x: np.ndarray, dtype: DType) -> np.ndarray:
    return x.view(np.uint16 if dtype.itemsize == 2 else np.uint32)


@pytest.mark.mlx
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_quantize_equals_mlx_bit_for_bit(dtype: str, bits: int, group: int) -> None:
    import mlx.core as mx

    d = DTYPES[dtype]
    rng = np.random.default_rng()  # fresh inputs every run: the rule, not a lucky sample
    for _ in range(6):
        rows, cols = int(rng.integers(1, 24)), group * int(rng.integers(1, 5))
        w32 = weights(rng, rows, cols, group)
        a = as_mlx(w32, d)
        ours = quantize(from_float32(w32, d), d, bits, group)
        wq, scales, biases = mx.quantize(a, group_size=group, bits=bits)
        assert np.array_equal(ours[0], np.array(wq)), f"packed codes differ ({dtype}, {bits} bits, group {group})"
        assert np.array_equal(storage_bits(ours[1], d), bits_of(scales, d)), "scales differ"
        assert np.array_equal(storage_bits(ours[2], d), bits_of(biases, d)), "biases differ"


@pytest.mark.mlx
@pytest.mark.parametrize("bits", [4, 8])
def test_dequantize_equals_mlx(bits: int) -> None:
    """What our checks read back is what MLX multiplies by."""
    import mlx.core as mx

    rng = np.random.default_rng()
    w32 = weights(rng, 8, 128, 64)
    packed, scales, biases = quantize(w32, FLOAT32, bits, 64)
    ours = dequantize(packed, scales, biases, FLOAT32, bits)
    theirs = np.array(mx.dequantize(mx.array(packed), mx.array(scales), mx.array(biases), group_size=64, bits=bits))
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-6 * np.abs(w32).max())


def test_the_largest_magnitude_is_exact_and_the_rest_within_a_step() -> None:
    """Without MLX: the rule's promises, on random groups (an independent property check): the
    value of largest magnitude comes back exactly; the others within one step (half a step on
    the grid, up to a step for the far extreme, which the exact edge may push past the grid)."""
    rng = np.random.default_rng()
    w32 = (rng.standard_normal((16, 256))).astype(np.float32)
    packed, scales, biases = quantize(w32, FLOAT32, 4, 64)
    back = dequantize(packed, scales, biases, FLOAT32, 4).reshape(16, 4, 64)
    g = w32.reshape(16, 4, 64)
    edge = np.take_along_axis(g, np.abs(g).argmax(-1)[..., None], -1)
    got = np.take_along_axis(back, np.abs(g).argmax(-1)[..., None], -1)
    np.testing.assert_allclose(got, edge, rtol=1e-6)
    step = np.abs(scales.reshape(16, 4, 1))
    assert (np.abs(back - g) <= step * (1 + 1e-5)).all()


@pytest.mark.parametrize(("bits", "group"), [(3, 64), (16, 64), (4, 48), (4, 0)])
def test_unsupported_parameters_are_refused(bits: int, group: int) -> None:
    with pytest.raises(UserError):
        check_params(bits, group)
