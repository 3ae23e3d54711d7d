"""Prefill shapes prepared before a server takes requests, so that a prompt length it has not seen
never stops the loop to compile a kernel (or time the SSD scan's choices) while others wait.

What Triton compiles for a launch is a function of its constexprs and of each integer argument's
class (1, a multiple of 16, other: `compile_watch.int_class`); our kernels derive their constexprs
from the layer's dimensions and from powers of two above the forward's token count T and its
sequence count S (block sizes, the SSD choice's bucket: `ssd.auto_key_of`).  So one forward per
(bucket of T, class of T) x (bucket of S, class of S) that can occur meets every specialization a
prefill of at most `max_tokens` tokens in at most `max_seqs` sequences can ask for, whatever the
lengths inside it.  `prefill_shapes` lists those forwards; `warm_prefill` runs them through
`Runtime.generate` (one token each: a prefill and no decode step), on every rank.

Decode steps are not here: on CUDA they replay graphs per (batch bucket, sampling mode), captured
with no live sequence (`graphs.py`).  The server does not call this yet (docs/serve.md, "Compiles
after warm-up", says why).  tests/serve/test_warm_shapes.py checks the claim on the CPU, under
Triton's interpreter, with `compile_watch` counting specializations.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def _classes_in(low: int, high: int) -> list[int]:
    """One value of each Triton integer class in (low, high]: 1, a multiple of 16, another."""
    out = []
    if low < 1 <= high:
        out.append(1)
    sixteen = (low // 16 + 1) * 16
    if sixteen <= high:
        out.append(sixteen)
    other = next((v for v in range(high, low, -1) if v != 1 and v % 16), None)
    if other is not None:
        out.append(other)
    return out


def representatives(limit: int) -> list[int]:
    """Values in 1..limit that meet every (power-of-two bucket, integer class) pair there is."""
    out: list[int] = []
    low, high = 0, 1
    while low < limit:
        out += _classes_in(low, min(high, limit))
        low, high = high, high * 2
    return sorted(set(out))


def prefill_shapes(max_tokens: int, max_seqs: int) -> list[tuple[int, int]]:
    """(T, S): one prefill forward of T tokens in S sequences per specialization class (S <= T), and
    S prompts of one token each (T == S: a forward that the attention runs as a decode)."""
    seqs = representatives(min(max_seqs, max_tokens))
    shapes = {(t, s) for t in representatives(max_tokens) for s in representatives(min(t, max_seqs))}
    return sorted(shapes | {(s, s) for s in seqs})


def prompts_of(tokens: int, seqs: int, token_id: int) -> list[list[int]]:
    """`seqs` prompts of `tokens` tokens in all, as even as can be (the first ones one longer)."""
    base, extra = divmod(tokens, seqs)
    return [[token_id] * (base + (1 if i < extra else 0)) for i in range(seqs)]


def warm_prefill(runtime: Any, max_tokens: int, max_seqs: int, token_id: int = 0) -> Iterator[tuple[int, int]]:
    """Run every shape of `prefill_shapes` as one prefill forward (yields each after it ran)."""
    for tokens, seqs in prefill_shapes(max_tokens, max_seqs):
        runtime.generate(prompts_of(tokens, seqs, token_id), 1, max_batch=seqs)
        yield tokens, seqs
