"""PyTorch backend of ``plamo2_tools.kernels.Ops``: vectorised, CPU and CUDA, fp32 inside.

Loops run over sequences or chunks, never over tokens.  The SSD scan is the chunked ("ssd_minimal")
form of the recurrence in ``reference_ops.ssd_recurrence``:

    a_i      = sum_{k<=i} delta_k A                    (log decay from the chunk start, per head)
    y_i      = sum_{j<=i in chunk} (C_i.B_j) exp(a_i - a_j) delta_j x_j     (intra-chunk)
             + exp(a_i) C_i . S_start                                       (carried state)
    S_end    = exp(a_last) S_start + sum_j exp(a_last - a_j) delta_j x_j (outer) B_j
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

Tensor = torch.Tensor

# Prefill SDPA backends, cuDNN's left out: it builds (and caches) an execution plan for every new
# (queries, keys) shape, ~25 ms of host time each, and a GSM8K run brings a new prompt length with
# nearly every request (H200, plamo-2-1b: prefill fell from ~180k to 39k tokens/s; reports/e2e/
# session4).  Flash and memory-efficient attention take any length without a plan.
_PREFILL_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> tuple[Tensor, Tensor]:
    # The norm reads the rounded residual so that y is a function of the returned stream.
    r = x if residual is None else (x.float() + residual.float()).to(residual.dtype)
    return _rms(r, weight, eps).to(x.dtype), r


def head_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return _rms(x, weight, eps).to(x.dtype)


def linear(x: Tensor, weight: Tensor) -> Tensor:
    return F.linear(x, weight)


def silu_mul(x: Tensor) -> Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def causal_conv1d(
    x: Tensor,
    weight: Tensor,
    cu_seqlens: Tensor,
    conv_state: Tensor | None = None,
    has_initial_state: Tensor | None = None,
) -> Tensor:
    """Packed depthwise causal conv + SiLU (``has_initial_state=None`` means no sequence has one).

    Each sequence's K-1 history rows (its conv state or zeros) are stacked in front of x, so every
    tap of every token is one gather: row ``hist(s, p)`` for local position p < 0, else x.
    """
    T, Cch = x.shape
    K = weight.shape[1]
    dev = x.device
    cu = cu_seqlens.to(device=dev, dtype=torch.long)
    S = cu.numel() - 1
    lens = cu.diff()
    hist = torch.zeros(S, K - 1, Cch, device=dev)
    if conv_state is not None and has_initial_state is not None:
        keep = has_initial_state.to(device=dev, dtype=torch.bool).view(S, 1, 1)
        hist = torch.where(keep, conv_state.transpose(1, 2).float(), hist)
    src = torch.cat([hist.reshape(S * (K - 1), Cch), x.float()])

    def rows(seq: Tensor, pos: Tensor) -> Tensor:
        return torch.where(pos >= 0, S * (K - 1) + cu[seq] + pos, seq * (K - 1) + (K - 1) + pos)

    seq = torch.repeat_interleave(torch.arange(S, device=dev), lens, output_size=T)
    pos = torch.arange(T, device=dev) - cu[seq]
    taps = torch.arange(K, device=dev) - (K - 1)  # tap k reads position t - (K-1) + k
    idx = rows(seq[:, None], pos[:, None] + taps)
    w = weight.float()
    u = torch.zeros(T, Cch, device=dev)
    for k in range(K):
        u += src[idx[:, k]] * w[:, k]
    if conv_state is not None:  # the last K-1 inputs of each sequence, history included
        last = rows(torch.arange(S, device=dev)[:, None], lens[:, None] + taps[:-1])
        conv_state.copy_(src[last].transpose(1, 2))
    return F.silu(u).to(x.dtype)


def causal_conv1d_update(x: Tensor, conv_state: Tensor, weight: Tensor) -> Tensor:
    window = torch.cat([conv_state, x[:, :, None].to(conv_state.dtype)], dim=-1)  # (B, C, K)
    y = F.silu((window.float() * weight.float()).sum(-1))
    conv_state.copy_(window[:, :, 1:])
    return y.to(x.dtype)


def _ssd_sequence(
    x: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, state: Tensor, Q: int
) -> tuple[Tensor, Tensor]:
    """One sequence, fp32: x (L, H, P), delta (L, H), B/C (L, N), state (H, P, N).

    Returns the state part of y (L, H, P) (no D, no gate) and the final state.
    """
    L, H, P = x.shape
    N = B.shape[-1]
    # A sequence shorter than a chunk is one chunk of its own length: the math does not depend on Q, and
    # padding a 32-token prompt to 256 made the (Q, Q, H) products 64x the work (serving on the CPU spent
    # 77% of its loop there; docs/serve.md, "Where the time goes").
    Q = max(1, min(Q, L))
    pad = -L % Q  # padded tokens have delta = 0: decay 1 and no input, so the state passes intact
    x, delta, B, C = (F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad)) for t in (x, delta, B, C))
    nc = (L + pad) // Q
    x, delta = x.view(nc, Q, H, P), delta.view(nc, Q, H)
    B, C = B.view(nc, Q, N), C.view(nc, Q, N)
    a = torch.cumsum(delta * A, dim=1)  # (nc, Q, H)

    causal = torch.ones(Q, Q, dtype=torch.bool, device=x.device).tril()
    seg = (a[:, :, None, :] - a[:, None, :, :]).masked_fill(~causal[:, :, None], float("-inf"))
    scores = (C @ B.transpose(1, 2))[..., None] * seg.exp() * delta[:, None, :, :]  # (nc,Qi,Qj,H)
    y = torch.einsum("cijh,cjhp->cihp", scores, x)

    to_end = (a[:, -1:, :] - a).exp() * delta  # weight of token j in its chunk's end state
    chunk_states = torch.einsum("cjh,cjhp,cjn->chpn", to_end, x, B)
    chunk_decay = a[:, -1].exp()  # (nc, H)
    starts = []
    for c in range(nc):  # sequential over chunks only
        starts.append(state)
        state = chunk_decay[c, :, None, None] * state + chunk_states[c]
    y += torch.einsum("cin,chpn,cih->cihp", C, torch.stack(starts), a.exp())
    return y.reshape(nc * Q, H, P)[:L], state


def ssd_chunk_scan(
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
    T, H, P = x.shape
    N = B.shape[-1]
    cu = cu_seqlens.tolist()
    S = len(cu) - 1
    xf = x.float()
    delta = F.softplus(dt.float() + dt_bias.float())
    Af, Bf, Cf = A.float(), B.float(), C.float()
    y = torch.empty(T, H, P, device=x.device)
    final = torch.empty(S, H, P, N, device=x.device)
    for s in range(S):
        t0, t1 = cu[s], cu[s + 1]
        h0 = initial_state[s].float() if initial_state is not None else final.new_zeros(H, P, N)
        y[t0:t1], final[s] = _ssd_sequence(xf[t0:t1], delta[t0:t1], Af, Bf[t0:t1], Cf[t0:t1], h0, chunk_size)
    y += D.float()[:, None] * xf
    if z is not None:
        y *= F.silu(z.float())
    return y.to(x.dtype), final


def ssd_state_update(
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
    xf = x.float()
    delta = F.softplus(dt.float() + dt_bias.float())  # (B, H)
    decay = torch.exp(delta * A.float())[:, :, None, None]
    new = decay * state.float() + (delta[:, :, None] * xf)[..., None] * B.float()[:, None, None, :]
    state.copy_(new)
    y = torch.einsum("bhpn,bn->bhp", new, C.float()) + D.float()[:, None] * xf
    if z is not None:
        y *= F.silu(z.float())
    return y.to(x.dtype)


def attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cu_seqlens_q: Tensor,
    kv_lens: Tensor,
    scale: float,
    window: int | None = None,
) -> Tensor:
    """SDPA per sequence; keys no query of the sequence can see are sliced off, not masked.

    Pure decode (one query per sequence, Tq == S) is one masked SDPA call without a host sync.
    Every sequence has at least one query.
    """
    gqa = q.shape[1] != k_cache.shape[2]
    if q.shape[0] == kv_lens.shape[0]:
        kpos = torch.arange(k_cache.shape[1], device=q.device)[None, :]
        last = kv_lens.to(q.device)[:, None] - 1
        mask = kpos <= last
        if window is not None:
            mask &= last - kpos <= window
        o = F.scaled_dot_product_attention(
            q[:, :, None],
            k_cache.transpose(1, 2),
            v_cache.transpose(1, 2),
            attn_mask=mask[:, None, None, :],
            scale=scale,
            enable_gqa=gqa,
        )
        return o[:, :, 0]
    with sdpa_kernel(_PREFILL_SDPA):
        return _prefill_attention(q, k_cache, v_cache, cu_seqlens_q.tolist(), kv_lens.tolist(), scale, window)


def _prefill_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, cu: list[int], lens: list[int], scale: float, window: int | None
) -> Tensor:
    out = torch.empty_like(q)
    gqa = q.shape[1] != k_cache.shape[2]
    group = q.shape[1] // k_cache.shape[2]
    for s, L in enumerate(lens):
        q0, q1 = cu[s], cu[s + 1]
        n = q1 - q0
        # With a window, query blocks of >= window rows each see at most 2 windows of keys, so
        # the masked (non-flash) SDPA does O(n * window) work, not O(n * L).
        blk = n if window is None else max(window, 256)
        for a in range(0, n, blk):
            b = min(n, a + blk)
            first, stop = L - n + a, L - n + b  # absolute positions of the block's queries
            k0 = 0 if window is None else max(0, first - window)
            qs = q[q0 + a : q0 + b].transpose(0, 1)
            ks, vs = k_cache[s, k0:stop].transpose(0, 1), v_cache[s, k0:stop].transpose(0, 1)
            if gqa:  # explicit heads: SDPA's flash kernels do not all take enable_gqa
                ks, vs = ks.repeat_interleave(group, dim=0), vs.repeat_interleave(group, dim=0)
            mask, causal = None, False
            if k0 == first and b - a == stop - k0 and (window is None or b - a <= window + 1):
                # Square causal (a window no wider than the block cuts nothing): lets SDPA pick
                # its flash kernel instead of a masked one.
                causal = True
            elif b - a > 1:  # one query sees every key of its slice
                qpos = torch.arange(first, stop, device=q.device)[:, None]
                kpos = torch.arange(k0, stop, device=q.device)[None, :]
                mask = kpos <= qpos
                if window is not None:
                    mask &= qpos - kpos <= window
            # 4-D (1, H, n, d): SDPA's flash and memory-efficient kernels take only 4-D inputs; 3-D
            # ones fell back to the math kernel (H200: 101 ms for 1b at T = 16384, ~11 TFLOP/s).
            o = F.scaled_dot_product_attention(
                qs[None], ks[None], vs[None], attn_mask=mask, is_causal=causal, scale=scale
            )
            out[q0 + a : q0 + b] = o[0].transpose(0, 1)
    return out


# ---- fusions (one launch each in the Triton backend; the same rounding points here) ------------
def norm_add_norm(x: Tensor, w1: Tensor, residual: Tensor, w2: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """rms(x; w1) rounded, added into the residual (rounded), then rms(r; w2).  Returns (y, r)."""
    return rms_norm(rms_norm(x, w1, eps)[0], w2, eps, residual)


def bcdt_rms_norm(bcdt: Tensor, wB: Tensor, wC: Tensor, wdt: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    N = wB.shape[0]
    B, C, dt = bcdt[:, :N], bcdt[:, N : 2 * N], bcdt[:, 2 * N :]
    return (
        _rms(B, wB, eps).to(bcdt.dtype),
        _rms(C, wC, eps).to(bcdt.dtype),
        _rms(dt, wdt, eps).to(bcdt.dtype),
    )


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def qk_norm_rope(
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
    """Per-head q/k norms + NeoX RoPE in fp32 (one rounding), K/V written into the caches."""
    T = qkv.shape[0]
    Hq, d = q_weight.shape
    Hkv = k_weight.shape[0]
    q, k, v = qkv.split([Hq * d, Hkv * d, Hkv * d], dim=-1)
    cos, sin = cos.reshape(T, 1, d).float(), sin.reshape(T, 1, d).float()
    q = _rope(_rms(q.reshape(T, Hq, d), q_weight, eps), cos, sin)
    k = _rope(_rms(k.reshape(T, Hkv, d), k_weight, eps), cos, sin)
    k_cache[seq_index, positions] = k.to(k_cache.dtype)
    v_cache[seq_index, positions] = v.reshape(T, Hkv, d).to(v_cache.dtype)
    return q.to(qkv.dtype)
