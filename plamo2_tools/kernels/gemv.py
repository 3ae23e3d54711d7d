"""Triton GEMV for decode: y = x @ W^T with few rows of x (M <= 8), reading W once at memory speed.

At batch 1 a decode step is a sequence of matrix-vector products that read every weight once:
the step's floor is the weights' bytes over the copy rate.  cuBLAS runs these at ~72 % of the copy
rate on an H200 and adds split-K reduce launches (reports/e2e/README.md, decode profile).  Here
each program owns BLOCK_N output columns and streams their rows of W (contiguous, K long) through
registers, multiplying by all M rows of x at once (each W element is read once, however many rows
x has) and accumulating in float32 in a fixed order, so results are deterministic.  No tensor
cores: at M <= 8 the work is a few FMAs per byte, far below what the memory delivers.

Used by `triton_ops.linear` for CUDA inputs with at most GEMV_MAX_M rows; everything else goes to
cuBLAS (F.linear).  The configurations are autotuned per (M bucket, N, K) and kept between runs
(Triton's cache_results).
"""

from __future__ import annotations

import inspect
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
GEMV_MAX_M = 8

if _INTERPRET:  # one config: multi-config autotune needs a GPU driver
    _CONFIGS = [triton.Config({"BLOCK_N": 4, "BLOCK_K": 64}, num_warps=1)]
else:
    _CONFIGS = [
        triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
        for bn, bk, w, s in ((4, 512, 4, 3), (8, 256, 4, 3), (8, 512, 4, 2), (8, 512, 8, 3), (16, 256, 4, 3),
                             (16, 512, 8, 2), (4, 1024, 8, 2), (2, 1024, 4, 3))
    ]  # fmt: skip
_CACHE_RESULTS = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}
_MAX_TILE = 16384  # x-times-W products held per program (BLOCK_M * BLOCK_N * BLOCK_K): past this they spill


def _prune(configs: list, named_args: dict, **kwargs: object) -> list:
    """Configurations whose product tile fits in registers for this row count (fewer to compile and
    time at warm-up, and none that would spill)."""
    bm = named_args.get("BLOCK_M", kwargs.get("BLOCK_M", 1))
    fit = [c for c in configs if bm * c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_K"] <= _MAX_TILE]
    return fit or configs[:1]


@triton.autotune(configs=_CONFIGS, key=["BLOCK_M", "N", "K"], prune_configs_by={"early_config_prune": _prune},
                 **({} if _INTERPRET else _CACHE_RESULTS))  # fmt: skip
@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, y_ptr, M, N, K, sx, sw, sy,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)  # N * K passes 2**31 elements for a large head
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    n_ok, m_ok = n < N, m < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        w = tl.load(w_ptr + n[:, None] * sw + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptr + m[:, None] * sx + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    tl.store(y_ptr + m[:, None] * sy + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (M, K) with M <= GEMV_MAX_M, w (N, K): x @ w.T in x's dtype, accumulated in float32."""
    M, K = x.shape
    N = w.shape[0]
    assert M <= GEMV_MAX_M and w.shape[1] == K, (x.shape, w.shape)
    if x.stride(1) != 1:
        x = x.contiguous()
    if w.stride(1) != 1:
        w = w.contiguous()
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    block_m = triton.next_power_of_2(M)

    def grid(meta: dict) -> tuple[int]:
        return (triton.cdiv(N, meta["BLOCK_N"]),)

    _gemv_kernel[grid](x, w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0), BLOCK_M=block_m)
    return y


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, w)` for any 2-D x: the GEMV on CUDA for a few rows, cuBLAS otherwise."""
    if x.is_cuda and x.dim() == 2 and x.shape[0] <= GEMV_MAX_M and w.dtype == x.dtype and not _INTERPRET:
        return gemv(x, w)
    return F.linear(x, w)
