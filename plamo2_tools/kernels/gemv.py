"""Triton GEMV for decode: y = x @ W^T for one row of x, reading W once at memory speed.

At batch 1 a decode step is a sequence of matrix-vector products that read every weight once:
the step's floor is the weights' bytes over the copy rate.  cuBLAS runs these at ~72 % of the copy
rate on an H200 and adds split-K reduce launches (reports/e2e/README.md, decode profile).  Here
each program owns BLOCK_N output columns and streams their rows of W (contiguous, K long) through
registers, accumulating in float32 in a fixed order, so results are deterministic.  No tensor
cores: one FMA per weight element, far below what the memory delivers.

Used by `triton_ops.linear` for CUDA inputs of one row; everything else goes to cuBLAS
(F.linear).  The configurations are autotuned per (N, K), seeded first from the card's shipped
table (kernels/tuned.py) and kept between runs (cache_results).
"""

from __future__ import annotations

import inspect
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import tuned

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# One row: the decode step of one sequence.  Two or more rows go to cuBLAS: measured on an H200
# (reports/e2e/session3/bench_runtime_1b.json) a multi-row variant of this kernel lost badly (2.3k
# against 5.9k tokens/s at batch 8), and at batch 1 the question is decided per run by measurement
# (PLAMO2_GEMV=0 turns this kernel off: `python -m bench throughput` run with and without it).
GEMV_MAX_M = 1

# What the autotuner chooses from on a GPU (a card's tuned table may only name one of these).
GPU_CONFIGS = [
    triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
    for bn, bk, w, st in (
        (4, 1024, 4, 3),
        (8, 512, 4, 3),
        (8, 1024, 8, 3),
        (16, 512, 8, 3),
        (16, 256, 4, 4),
        (32, 256, 8, 3),
        (2, 2048, 4, 3),
    )
]
# One config under the interpreter: multi-config autotune needs a GPU driver.
_CONFIGS = [triton.Config({"BLOCK_N": 4, "BLOCK_K": 64}, num_warps=1)] if _INTERPRET else GPU_CONFIGS
_CACHE_RESULTS = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}


def enabled() -> bool:
    return os.environ.get("PLAMO2_GEMV", "1") != "0"


@triton.autotune(configs=_CONFIGS, key=["N", "K"], **({} if _INTERPRET else _CACHE_RESULTS))
@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, sw, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[n] = sum_k x[k] w[n, k] for BLOCK_N rows of W: each thread keeps float32 partial products
    of its slice of the tile across the whole K loop (no reduction inside the loop, so the loads
    stream), and the tile is reduced once at the end."""
    pid = tl.program_id(0).to(tl.int64)  # N * K passes 2**31 elements for a large head
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        w = tl.load(w_ptr + n[:, None] * sw + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptr + k, mask=k_ok, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    tl.store(y_ptr + n, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=n_ok)


def gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (1, K), w (N, K): x @ w.T in x's dtype, accumulated in float32 in a fixed order."""
    M, K = x.shape
    N = w.shape[0]
    assert M == 1 and w.shape[1] == K, (x.shape, w.shape)
    x = x.contiguous()
    if w.stride(1) != 1:
        w = w.contiguous()
    y = torch.empty(1, N, dtype=x.dtype, device=x.device)
    if N == 0:
        return y

    def grid(meta: dict) -> tuple[int]:
        return (triton.cdiv(N, meta["BLOCK_N"]),)

    if x.is_cuda:
        tuned.seed_once(_gemv_kernel, "gemv", x.device)
    _gemv_kernel[grid](x, w, y, N, K, w.stride(0))
    return y


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, w)` for any 2-D x: the GEMV on CUDA for one row, cuBLAS otherwise."""
    if x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and w.dtype == x.dtype and not _INTERPRET and enabled():
        return gemv(x, w)
    return F.linear(x, w)


def gemv_autotuner() -> triton.runtime.Autotuner:
    """The GEMV's Triton autotuner (its decisions go into a card's tuned table: kernels/tuned.py)."""
    return _gemv_kernel
