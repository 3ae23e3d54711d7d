"""Plain, obviously-correct versions of every hot operation, one sequence at a time.

These are the oracles: the reference forward is built from them, and every kernel (PyTorch path
and Triton) is tested against them, usually in float64.  They favour readability over speed: the
Mamba recurrence is the sequential loop of the spec (docs/model.md §3.2), not a chunked
reformulation.  Every function computes in the dtype of its inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last axis (weight is the *effective* scale)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def causal_conv1d_silu(
    x: torch.Tensor, weight: torch.Tensor, initial_state: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv over time then SiLU.

    x: (T, C) raw inputs; weight: (C, K); initial_state: (C, K-1) raw inputs that came before x,
    oldest first (zeros when None).  Returns y (T, C) = silu(conv) and the final state (C, K-1):
    the last K-1 raw inputs, oldest first.
    """
    T, C = x.shape
    K = weight.shape[1]
    if initial_state is None:
        initial_state = x.new_zeros(C, K - 1)
    window = torch.cat([initial_state.t(), x], dim=0)  # (K-1+T, C)
    u = torch.stack([(window[t : t + K].t() * weight).sum(-1) for t in range(T)]) if T else x
    return F.silu(u), window[T:].t().contiguous()


def ssd_recurrence(
    x: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    z: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Mamba2 / PLaMo 2 selective scan, token by token, one group of B/C shared by all heads.

    x: (T, H, P); delta: (T, H) = softplus(dt + dt_bias) (already applied); A: (H,) negative;
    B, C: (T, N); D: (H,); z: (T, H, P) gate or None; initial_state: (H, P, N) or None.
      S_t = exp(delta_t * A) * S_{t-1} + delta_t * x_t (outer) B_t
      y_t = S_t . C_t + D * x_t ;  y_t *= silu(z_t)
    Returns y (T, H, P) and the final state (H, P, N).
    """
    T, H, P = x.shape
    N = B.shape[-1]
    state = x.new_zeros(H, P, N) if initial_state is None else initial_state.clone()
    ys = []
    for t in range(T):
        decay = torch.exp(delta[t] * A)[:, None, None]
        state = decay * state + delta[t][:, None, None] * x[t][:, :, None] * B[t][None, None, :]
        ys.append(state @ C[t] + D[:, None] * x[t])
    y = torch.stack(ys) if ys else x.new_zeros(0, H, P)
    if z is not None:
        y = y * F.silu(z)
    return y, state


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Causal softmax attention for one sequence, GQA by contiguous groups.

    q: (Tq, Hq, d) are the LAST Tq positions of the Tk keys k, v: (Tk, Hkv, d).  Query at absolute
    position i sees keys j with j <= i and, when window is set, i - j <= window (HF semantics:
    itself plus the previous `window` tokens).
    """
    Tq, Hq, _ = q.shape
    Tk, Hkv, _ = k.shape
    group = Hq // Hkv
    k = k.repeat_interleave(group, dim=1)  # query head h uses KV head h // group
    v = v.repeat_interleave(group, dim=1)
    qpos = torch.arange(Tk - Tq, Tk)[:, None]
    kpos = torch.arange(Tk)[None, :]
    allowed = kpos <= qpos
    if window is not None:
        allowed &= (qpos - kpos) <= window
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
