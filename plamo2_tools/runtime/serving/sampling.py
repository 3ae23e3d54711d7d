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
"""

from __future__ import annotations

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


def top_p_mask(probs: Tensor, top_p: float) -> Tensor:
    """True for the tokens nucleus sampling keeps (the most likely one always)."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    keep_sorted = sorted_p.cumsum(-1) - sorted_p < top_p
    return torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)


def select_tokens(logits: Tensor, keys: Tensor, steps: Tensor, temperature: float, top_p: float) -> Tensor:
    """(B,) int64 next tokens: greedy for temperature <= 0, else seeded temperature + top-p sampling.

    `keys` and `steps` (B,) int64: each row's request key and how many tokens it has generated.
    """
    if temperature <= 0:
        return logits.argmax(-1)
    scaled = logits.float() / temperature
    gumbel = -torch.log(-torch.log(uniforms(keys, steps, logits.shape[-1])))
    score = scaled + gumbel
    if top_p < 1.0:
        keep = top_p_mask(torch.softmax(scaled, dim=-1), top_p)
        score = score.masked_fill(~keep, float("-inf"))
    return score.argmax(-1)
