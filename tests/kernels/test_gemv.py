"""The decode GEMV (kernels/gemv.py) against a float64 matmul on fresh random inputs: one row,
widths and depths that are not multiples of its blocks, a strided row, a NaN-poisoned output
buffer (conftest), and F.linear taking over beyond one row.  On the CPU it
runs under Triton's interpreter (fp32/fp16: the interpreter's bf16 arithmetic is not the GPU's);
the GPU test adds bf16 at real shapes."""

from __future__ import annotations

import pytest
import torch

from plamo2_tools.kernels.gemv import GEMV_MAX_M, gemv, linear


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.double() @ w.double().T


@pytest.mark.parametrize("M", range(1, GEMV_MAX_M + 1))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_gemv_equals_a_float64_matmul(M: int, dtype: torch.dtype, seed: int) -> None:
    g = torch.Generator().manual_seed(100 * seed + M)
    N, K = 37, 203  # neither a multiple of a block
    x = torch.randn(M, K, generator=g).to(dtype)
    w = torch.randn(N, K, generator=g).to(dtype)
    got = gemv(x, w)
    assert got.dtype == dtype and got.shape == (M, N)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), _reference(x, w), rtol=tol, atol=tol * K**0.5)


def test_gemv_takes_a_strided_row_of_a_wider_buffer() -> None:
    g = torch.Generator().manual_seed(7)
    base = torch.randn(3, 96, generator=g)
    x = base[1:2, 10:74]  # a view into a wider buffer (the runtime's zx halves)
    w = torch.randn(20, 64, generator=g)
    torch.testing.assert_close(gemv(x, w).double(), _reference(x, w), rtol=1e-5, atol=1e-4)


def test_linear_is_f_linear_off_the_gpu_and_beyond_the_rows() -> None:
    x, w = torch.randn(GEMV_MAX_M + 1, 16), torch.randn(5, 16)
    assert torch.equal(linear(x, w), torch.nn.functional.linear(x, w))
    assert torch.equal(linear(x[:2], w), torch.nn.functional.linear(x[:2], w))  # CPU: cuBLAS's twin


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 2, 8])
@pytest.mark.parametrize("N, K", [(4096 + 4096, 2048), (2048, 8192), (100032, 2048), (2560, 10240), (161, 4096)])
def test_gemv_on_the_gpu_in_bf16(M: int, N: int, K: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(M * 7 + N)
    x = torch.randn(M, K, generator=g, device="cuda").bfloat16()
    w = (torch.randn(N, K, generator=g, device="cuda") / K**0.5).bfloat16()
    got = linear(x, w)
    ref = _reference(x, w)
    err = (got.double() - ref).abs().max() / ref.abs().max()
    assert err < 1e-2, err  # bf16 output rounding; accumulation is float32
    assert torch.equal(got, linear(x, w))  # deterministic
