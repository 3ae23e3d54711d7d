"""A second, independent PLaMo 2 forward, written from docs/model.md without importing anything
from `plamo2_tools`, so the reference forward and its oracles have something to disagree with.

Where the reference takes the obvious route, this one takes another:

- weights come from `safetensors.safe_open` (not our reader), config from raw JSON with our own
  defaults and our own port of HF's `is_mamba`;
- in_proj is split through a (Hm, 2, d, D) view of the weight, not a view of the activations;
- the causal conv is `F.conv1d` (depthwise, left padding), not a sliding window sum;
- the Mamba recurrence is the chunked SSD form (`ssd_minimal` of the Mamba2 paper: intra-chunk
  quadratic term plus an inter-chunk state pass), not the token-by-token loop;
- RoPE is a complex rotation of (x[:d/2] + i x[d/2:]), not rotate_half;
- attention is `F.scaled_dot_product_attention` with an explicit boolean band mask, GQA by an
  explicit KV index h // (Hq / Hkv);
- RMSNorm is `F.rms_norm`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open

# docs/model.md §3.1, written out again on purpose (not imported from plamo2_tools.model.plamo2.config).
OFFSETS = {
    "pre_mixer_norm": 1.0,
    "post_mixer_norm": 0.2,
    "pre_mlp_norm": 1.0,
    "post_mlp_norm": 0.0894427190999916,  # 1 / 5**1.5
}
FINAL_OFFSET = 1.0
QK_EPS = 1e-6


# ---- configuration ----------------------------------------------------------------------------
def hf_is_mamba(raw: dict[str, Any], i: int) -> bool:
    """Port of HF modeling_plamo.py's `is_mamba` (docs/model.md §1)."""
    if not raw.get("mamba_enabled", True):
        return False
    step, n_layers = raw["mamba_step"], raw["num_hidden_layers"]
    assert step > 1 and i < n_layers
    if n_layers <= step // 2:
        return i != n_layers - 1  # too few layers: attention only in the last one
    return i % step != step // 2


@dataclass
class Model:
    raw: dict[str, Any]
    weights: dict[str, torch.Tensor]
    stats: dict[str, list[torch.Tensor]] = field(default_factory=dict)

    def get(self, key: str) -> Any:
        defaults = {
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "attention_window_size": 2048,
            "full_attention_idx": [],
            "tie_word_embeddings": True,
        }
        value = self.raw.get(key)
        return defaults[key] if value is None else value

    def record(self, key: str, value: torch.Tensor) -> None:
        self.stats.setdefault(key, []).append(value.detach())


def load(path: Path, dtype: torch.dtype = torch.float64) -> Model:
    """Config and every tensor of an HF checkpoint dir (single file or index), via safetensors."""
    raw = json.loads((path / "config.json").read_text())
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(path / name, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a dict
                weights[key] = f.get_tensor(key).to(dtype)
    return Model(raw, weights)


# ---- ops --------------------------------------------------------------------------------------
def rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None) -> torch.Tensor:
    """Pre-activation depthwise causal conv. x: (T, C); weight: (C, K); state: (C, K-1) or None."""
    C, K = weight.shape
    inp = x.T[None]  # (1, C, T)
    if state is None:
        return F.conv1d(inp, weight[:, None, :], padding=K - 1, groups=C)[0, :, : x.shape[0]].T
    return F.conv1d(torch.cat([state[None], inp], -1), weight[:, None, :], groups=C)[0].T


def segsum(x: torch.Tensor) -> torch.Tensor:
    """out[..., i, j] = sum_{j < k <= i} x[..., k] for j <= i, -inf above the diagonal."""
    T = x.shape[-1]
    x = x[..., None].expand(*x.shape, T)  # [..., k, j] = x[..., k]
    x = x.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(-1), 0)
    out = x.cumsum(-2)
    return out.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(0), -math.inf)


def ssd_chunked(
    x: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk: int,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ssd_minimal_discrete (Mamba2 paper, listing 1) for one sequence and one B/C group.

    x: (T, H, P); delta: (T, H); A: (H,); B, C: (T, N); initial_state: (H, P, N).
    Returns y (T, H, P) without the D term, and the final state (H, P, N).
    """
    T, H, P = x.shape
    N = B.shape[-1]
    pad = -T % chunk  # padded steps have delta = 0: no decay and no input, the state passes through
    X = F.pad(x * delta[..., None], (0, 0, 0, 0, 0, pad))
    dA = F.pad(delta * A, (0, 0, 0, pad))
    B, C = F.pad(B, (0, 0, 0, pad)), F.pad(C, (0, 0, 0, pad))
    c = (T + pad) // chunk
    X, B, C = X.view(c, chunk, H, P), B.view(c, chunk, N), C.view(c, chunk, N)
    dA = dA.view(c, chunk, H).permute(2, 0, 1)  # (H, c, l)
    cum = dA.cumsum(-1)
    # 1. Within each chunk: the quadratic (attention-like) form.
    Lmat = torch.exp(segsum(dA))  # (H, c, l, s)
    y_diag = torch.einsum("cln,csn,hcls,cshp->clhp", C, B, Lmat, X)
    # 2. The state each chunk produces on its own.
    decay_to_end = torch.exp(cum[..., -1:] - cum)  # (H, c, l)
    states = torch.einsum("cln,hcl,clhp->chpn", B, decay_to_end, X)
    # 3. Pass states between chunks.
    init = x.new_zeros(1, H, P, N) if initial_state is None else initial_state[None]
    states = torch.cat([init, states], 0)  # (c+1, H, P, N)
    decay_chunk = torch.exp(segsum(F.pad(cum[..., -1], (1, 0))))  # (H, c+1, c+1)
    new_states = torch.einsum("hzc,chpn->zhpn", decay_chunk, states)
    states, final = new_states[:-1], new_states[-1]
    # 4. What the incoming state contributes to each output.
    y_off = torch.einsum("cln,chpn,hcl->clhp", C, states, torch.exp(cum))
    y = (y_diag + y_off).reshape(c * chunk, H, P)[:T]
    return y, final


def rope_complex(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """NeoX RoPE as a complex rotation: pair j is (x[j], x[j + d/2])."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(d // 2, dtype=torch.float64) * 2 / d)
    rot = torch.polar(torch.ones(len(positions), d // 2, dtype=torch.float64), positions[:, None] * inv_freq)
    xc = torch.complex(x[..., : d // 2].double(), x[..., d // 2 :].double()) * rot[:, None, :]
    return torch.cat([xc.real, xc.imag], -1).to(x.dtype)


def band_mask(Tq: int, Tk: int, window: int | None) -> torch.Tensor:
    """True where query i (the last Tq of Tk positions) may see key j: j <= i, i - j <= window."""
    full = torch.ones(Tk, Tk, dtype=torch.bool)
    allowed = full.tril() if window is None else full.tril() & full.triu(-window)
    return allowed[Tk - Tq :]


def kv_index(Hq: int, Hkv: int) -> torch.Tensor:
    """The KV head each query head reads: contiguous groups (vLLM, llama.cpp; spec 4.5)."""
    return torch.arange(Hq) // (Hq // Hkv)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> torch.Tensor:
    """q: (Tq, Hq, d); k, v: (Tk, Hkv, d) -> (Tq, Hq, d); contiguous GQA, default 1/sqrt(d) scale."""
    kv_of = kv_index(q.shape[1], k.shape[1])
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k[:, kv_of].transpose(0, 1),
        v[:, kv_of].transpose(0, 1),
        attn_mask=band_mask(q.shape[0], k.shape[0], window),
    )
    return o.transpose(0, 1)


def attention_probs(q: torch.Tensor, k: torch.Tensor, window: int | None) -> torch.Tensor:
    """The softmax weights (Hq, Tq, Tk) of `sdpa`, for the health checks."""
    kv_of = kv_index(q.shape[1], k.shape[1])
    s = torch.einsum("qhd,khd->hqk", q, k[:, kv_of]) / math.sqrt(q.shape[-1])
    return s.masked_fill(~band_mask(q.shape[0], k.shape[0], window), -math.inf).softmax(-1)


# ---- the model --------------------------------------------------------------------------------
def mamba(m: Model, a: torch.Tensor, w: dict[str, torch.Tensor], chunk: int) -> torch.Tensor:
    r = m.raw
    T, D = a.shape
    Hm, d, N = r["mamba_num_heads"], r["hidden_size_per_head"], r["mamba_d_state"]
    eps = m.get("rms_norm_eps")
    w_in = w["in_proj.weight"].view(Hm, 2, d, D)  # per head: [z rows; x rows]
    z = torch.einsum("tk,hjk->thj", a, w_in[:, 0])
    x = torch.einsum("tk,hjk->thj", a, w_in[:, 1]).reshape(T, Hm * d)
    x = F.silu(causal_conv(x, w["conv1d.weight"][:, 0]))
    w_bcdt = w["bcdt_proj.weight"]
    B = rms(F.linear(x, w_bcdt[:N]), w["B_norm_weight"], eps)
    C = rms(F.linear(x, w_bcdt[N : 2 * N]), w["C_norm_weight"], eps)
    dt = rms(F.linear(x, w_bcdt[2 * N :]), w["dt_norm_weight"], eps)
    delta = F.softplus(F.linear(dt, w["dt_proj.weight"]) + w["dt_bias"])
    A = -torch.exp(w["A_log"])
    m.record("delta", delta)
    m.record("A", A)
    xh = x.view(T, Hm, d)
    y, _ = ssd_chunked(xh, delta, A, B, C, chunk)
    y = (y + w["D"][:, None] * xh) * F.silu(z)
    return F.linear(y.reshape(T, Hm * d), w["out_proj.weight"])


def attention(m: Model, a: torch.Tensor, w: dict[str, torch.Tensor], layer: int) -> torch.Tensor:
    r = m.raw
    T = a.shape[0]
    Hq, Hkv, d = r["num_attention_heads"], r["num_key_value_heads"], r["hidden_size_per_head"]
    q, k, v = F.linear(a, w["qkv_proj.weight"]).split([Hq * d, Hkv * d, Hkv * d], -1)
    q = rms(q.view(T, Hq, d), None, QK_EPS) * w["q_weight"]
    k = rms(k.view(T, Hkv, d), None, QK_EPS) * w["k_weight"]
    pos = torch.arange(T, dtype=torch.float64)
    full = layer in m.get("full_attention_idx")
    # PLaMo 2.1 (mlx-vlm's plamo2vl port): windowed layers rotate with rope_local_theta when given.
    theta = m.get("rope_theta") if full or r.get("rope_local_theta") is None else r["rope_local_theta"]
    q, k = rope_complex(q, pos, theta), rope_complex(k, pos, theta)
    window = None if full else m.get("attention_window_size")
    m.record("attention_probs", attention_probs(q, k, window))
    o = sdpa(q, k, v.view(T, Hkv, d), window)
    return F.linear(o.reshape(T, Hq * d), w["o_proj.weight"])


def layer(m: Model, h: torch.Tensor, i: int, chunk: int) -> torch.Tensor:
    p = f"model.layers.layers.{i}."
    w = {k.removeprefix(p + "mixer."): v for k, v in m.weights.items() if k.startswith(p + "mixer.")}
    eps = m.get("rms_norm_eps")

    def norm(x: torch.Tensor, name: str) -> torch.Tensor:
        return rms(x, OFFSETS[name] + m.weights[p + name + ".weight"], eps)

    a = norm(h, "pre_mixer_norm")
    mixed = mamba(m, a, w, chunk) if hf_is_mamba(m.raw, i) else attention(m, a, w, i)
    h = h + norm(mixed, "post_mixer_norm")
    b = norm(h, "pre_mlp_norm")
    F_ = m.raw["intermediate_size"]
    w_gu = m.weights[p + "mlp.gate_up_proj.weight"]
    f = F.linear(F.silu(F.linear(b, w_gu[:F_])) * F.linear(b, w_gu[F_:]), m.weights[p + "mlp.down_proj.weight"])
    return h + norm(f, "post_mlp_norm")


def hidden_states(m: Model, tokens: list[int], chunk: int = 5) -> list[torch.Tensor]:
    """[embedding output, after layer 0, ..., after layer L-1] for one sequence."""
    hs = [m.weights["model.embed_tokens.weight"][torch.tensor(tokens)]]
    for i in range(m.raw["num_hidden_layers"]):
        hs.append(layer(m, hs[-1], i, chunk))
    return hs


def logits(m: Model, tokens: list[int], chunk: int = 5) -> torch.Tensor:
    h = hidden_states(m, tokens, chunk)[-1]
    h = rms(h, FINAL_OFFSET + m.weights["model.norm.weight"], m.get("rms_norm_eps"))
    V = m.raw["vocab_size"]
    head = m.weights["model.embed_tokens.weight" if m.get("tie_word_embeddings") else "lm_head.weight"]
    return F.linear(h, head[:V])
