"""Token selection on the device that holds the logits, with no host round trip.

Greedy is ``argmax`` (the first maximum on ties, on every device).  Sampling is the Gumbel-max
trick, ``argmax(logits / T + g)`` with ``g = -log(-log u)``, where each uniform ``u`` is a pure
function of (request key, step, vocabulary index): a counter-based hash, not a stateful generator.
So a request draws the same noise whatever batch it shares, whichever slot it sits in, and however
many steps other requests took; only its own logits matter.  ``request_key(seed, index)`` mixes the
user's seed with the request's index in its call.

Top-p keeps the smallest set of most likely tokens whose mass reaches ``top_p`` (the most likely
token always), as a mask over the vocabulary, so the noise still belongs to the vocabulary entry.

All integer arithmetic is int64 with explicit wrap-around masks, which PyTorch computes the same on
the CPU and on CUDA; the tensors are a few operations over (batch, vocab), capturable in a graph.

Settings are per row (`select_rows`): each row has its own temperature and top-p, so one decode
graph serves every mix of requests.  What a graph computes is chosen by a *mode*, the cheapest that
covers the live rows: `GREEDY` (argmax only), `SAMPLE` (temperature, no nucleus), `TOP_P` (the
sort for the nucleus too).  A row's token is the same in every mode that covers it: greedy rows
take the argmax in all three, and a row with top_p = 1 keeps its whole vocabulary under `TOP_P`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

Tensor = torch.Tensor

_MASK64 = (1 << 64) - 1
# splitmix64 constants (as signed int64, the only 64-bit integer dtype torch has).
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def _signed(v: int) -> int:
    v &= _MASK64
    return v - (1 << 64) if v >= 1 << 63 else v


def _shr(x: Tensor, bits: int) -> Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: Tensor) -> Tensor:
    """splitmix64's finaliser: a bijection of 64-bit patterns with full avalanche."""
    x = (x ^ _shr(x, 30)) * _signed(_MIX1)
    x = (x ^ _shr(x, 27)) * _signed(_MIX2)
    return x ^ _shr(x, 31)


def _mix_int(v: int) -> int:
    v &= _MASK64
    v = ((v ^ (v >> 30)) * _MIX1) & _MASK64
    v = ((v ^ (v >> 27)) * _MIX2) & _MASK64
    return v ^ (v >> 31)


def request_key(seed: int, index: int) -> int:
    """The noise stream of request `index` of a call seeded with `seed` (an int64 pattern)."""
    return _signed(_mix_int(_mix_int(seed * _GOLDEN + 1) + index * _GOLDEN))


def uniforms(keys: Tensor, steps: Tensor, vocab: int) -> Tensor:
    """(B, vocab) float32 in (0, 1): u[b, v] = hash(keys[b], steps[b], v), 24 random bits each."""
    base = _mix(keys * _signed(_GOLDEN) + steps)  # (B,) one stream per (request, step)
    cols = torch.arange(vocab, device=keys.device, dtype=torch.int64)
    x = _mix(base[:, None] + cols[None, :] * _signed(_GOLDEN))
    return (_shr(x, 40).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


GREEDY, SAMPLE, TOP_P = "greedy", "sample", "top_p"
MODES = (GREEDY, SAMPLE, TOP_P)  # each covers the ones before it


def mode_of(temperature: float, top_p: float) -> str:
    """The cheapest mode that computes a row with these settings."""
    if temperature <= 0:
        return GREEDY
    return TOP_P if top_p < 1.0 else SAMPLE


def covering_mode(modes: Iterable[str]) -> str:
    """The cheapest mode that covers all of `modes` (GREEDY for none)."""
    return max(modes, key=MODES.index, default=GREEDY)


def top_p_mask(probs: Tensor, top_p: float | Tensor) -> Tensor:
    """True for the tokens nucleus sampling keeps (the most likely one always); `top_p` a number or
    one value per row, (B, 1)."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    keep_sorted = sorted_p.cumsum(-1) - sorted_p < top_p
    return torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)


def select_rows(logits: Tensor, keys: Tensor, steps: Tensor, temperature: Tensor, top_p: Tensor, mode: str) -> Tensor:
    """(B,) int64 next tokens with per-row settings: row b is greedy when temperature[b] <= 0, else
    seeded sampling at temperature[b] within the nucleus of mass top_p[b] (the whole vocabulary when
    top_p[b] >= 1).  `mode` must cover every row (see the module doc)."""
    greedy = logits.argmax(-1)
    if mode == GREEDY:
        return greedy
    t = temperature.to(torch.float32)
    hot = t > 0
    scaled = logits.float() / torch.where(hot, t, torch.ones_like(t))[:, None]
    score = scaled + -torch.log(-torch.log(uniforms(keys, steps, logits.shape[-1])))
    if mode == TOP_P:
        p = top_p.to(torch.float32)[:, None]
        keep = top_p_mask(torch.softmax(scaled, dim=-1), p) | (p >= 1.0)
        score = score.masked_fill(~keep, float("-inf"))
    return torch.where(hot, score.argmax(-1), greedy)


def select_tokens(logits: Tensor, keys: Tensor, steps: Tensor, temperature: float, top_p: float) -> Tensor:
    """(B,) int64 next tokens, one setting for every row: greedy for temperature <= 0, else seeded
    temperature + top-p sampling (`select_rows` with that setting on each row).

    `keys` and `steps` (B,) int64: each row's request key and how many tokens it has generated.
    """
    B, dev = logits.shape[0], logits.device
    temps = torch.full((B,), float(temperature), dtype=torch.float32, device=dev)
    tops = torch.full((B,), float(top_p), dtype=torch.float32, device=dev)
    return select_rows(logits, keys, steps, temps, tops, mode_of(temperature, top_p))
