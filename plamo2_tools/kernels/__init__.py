"""The hot operations of PLaMo 2, behind one interface with a PyTorch and a Triton backend.

All tensors are one tensor-parallel rank's local slice.  Prefill batches are packed (varlen, no
padding) and described by ``cu_seqlens`` (S+1 offsets starting at 0).  Every op computes in fp32
and returns the activation dtype; recurrent states are fp32 unless the caller passes bf16 ones.
The float64 oracles these are tested against live in ``plamo2_tools.model.reference_ops``.

    ops = get_ops("auto", device)      # Triton on CUDA when Triton imports, else PyTorch
    y, residual = ops.rms_norm(x, w, 1e-6, residual)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, cast

if TYPE_CHECKING:  # the interface is importable without torch (e.g. for --help); the backends need it
    import torch

    Tensor = torch.Tensor
else:
    Tensor = Any


class Ops(Protocol):
    """What the runtime calls.  Both ``torch_ops`` and ``triton_ops`` modules satisfy it."""

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(M, D) row norm; with ``residual``, r = x + residual first.  Returns (y, r)."""
        ...

    def head_rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        """(M, H, d) per-head norm over d with an (H, d) weight (q/k norm)."""
        ...

    def norm_add_norm(self, x: Tensor, w1: Tensor, residual: Tensor, w2: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        """Fused ``rms_norm(x, w1)`` -> add into ``residual`` -> ``rms_norm(r, w2)``.  Returns (y, r)."""
        ...

    def bcdt_rms_norm(
        self, bcdt: Tensor, wB: Tensor, wC: Tensor, wdt: Tensor, eps: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The Mamba B, C and dt pre-norms over one (M, 2N + R) row: returns (B, C, dt)."""
        ...

    def qk_norm_rope(
        self,
        qkv: Tensor,
        q_weight: Tensor,
        k_weight: Tensor,
        eps: float,
        cos: Tensor,
        sin: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        seq_index: Tensor,
        positions: Tensor,
    ) -> Tensor:
        """(M, (Hq + 2 Hkv) d) qkv: per-head q/k norms and NeoX RoPE (fp32 (M, d) cos/sin), K and V
        stored at ``cache[seq_index, positions]``.  Returns q (M, Hq, d)."""
        ...

    def linear(self, x: Tensor, weight: Tensor) -> Tensor:
        """(M, K) @ (N, K)^T in x's dtype (a projection; the Triton backend reads the weight at
        memory speed for the few rows of a decode step)."""
        ...

    def silu_mul(self, x: Tensor) -> Tensor:
        """(M, 2F) -> (M, F): silu(x[:, :F]) * x[:, F:]."""
        ...

    def causal_conv1d(
        self,
        x: Tensor,
        weight: Tensor,
        cu_seqlens: Tensor,
        conv_state: Tensor | None = None,
        has_initial_state: Tensor | None = None,
    ) -> Tensor:
        """Packed depthwise causal conv + SiLU; updates ``conv_state`` (S, C, K-1) in place."""
        ...

    def causal_conv1d_update(self, x: Tensor, conv_state: Tensor, weight: Tensor) -> Tensor:
        """One decode token per sequence: (B, C) with state (B, C, K-1) shifted in place."""
        ...

    def ssd_chunk_scan(
        self,
        x: Tensor,
        dt: Tensor,
        A: Tensor,
        B: Tensor,
        C: Tensor,
        D: Tensor,
        z: Tensor | None,
        dt_bias: Tensor,
        cu_seqlens: Tensor,
        initial_state: Tensor | None = None,
        chunk_size: int = 256,
    ) -> tuple[Tensor, Tensor]:
        """Packed Mamba2 scan.  Returns y (T, H, P) and fp32 final states (S, H, P, N).

        ``chunk_size`` is exact for the PyTorch path; the Triton one on CUDA treats it as a hint
        and picks its own chunk size and state-pass variant per shape (the result does not
        depend on the chunk size in exact arithmetic; see ``kernels.ssd``).
        """
        ...

    def ssd_state_update(
        self,
        state: Tensor,
        x: Tensor,
        dt: Tensor,
        A: Tensor,
        B: Tensor,
        C: Tensor,
        D: Tensor,
        z: Tensor | None,
        dt_bias: Tensor,
    ) -> Tensor:
        """One decode step; ``state`` (B, H, P, N) updated in place.  Returns y (B, H, P)."""
        ...

    def attention(
        self,
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        cu_seqlens_q: Tensor,
        kv_lens: Tensor,
        scale: float,
        window: int | None = None,
    ) -> Tensor:
        """Causal GQA attention of packed queries that are the last positions of each cache."""
        ...


def get_ops(backend: str = "auto", device: Any = None) -> Ops:
    """Pick a backend: "torch", "triton" or "auto" (Triton on CUDA devices when it imports)."""
    import torch

    if backend == "auto":
        if device is not None and torch.device(device).type == "cuda":
            try:
                return get_ops("triton")
            except ImportError:  # no (usable) Triton: the PyTorch path still runs on CUDA
                pass
        return get_ops("torch")
    if backend == "triton":
        from plamo2_tools.kernels import compile_watch, triton_ops

        compile_watch.install()  # count real compiles; watch every launch when PLAMO2_WATCH_KERNELS=1
        return cast(Ops, triton_ops)
    if backend == "torch":
        from plamo2_tools.kernels import torch_ops

        return cast(Ops, torch_ops)
    raise ValueError(f"unknown kernel backend {backend!r}")
