"""Seeded sampling checked against a recomputation from (seed, request, step), not against itself.

The documented rule (runtime/batching/sampling.py): request i of a call seeded with s draws its
token at step k (the first token is step 0) as argmax(logits / T + g) over the vocabulary (the
nucleus of mass top_p), g = -log(-log u), with u[v] a counter-based hash of (key(s, i), k, v).
The hash is written here again from that description in plain Python integers (splitmix64), and
every sampled token of a ragged batch is recomputed from the logits the run returned.  The
lengths are ragged and the batch is wide, so finished slots are compacted while sampling (the
keys and step counters must move with their requests).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from plamo2_tools.runtime.batching import graphs
from plamo2_tools.runtime.batching.engine import Runtime

M64 = (1 << 64) - 1
GOLDEN, MIX1, MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def mix(v: int) -> int:
    """splitmix64's finaliser on unsigned 64-bit integers."""
    v &= M64
    v = ((v ^ (v >> 30)) * MIX1) & M64
    v = ((v ^ (v >> 27)) * MIX2) & M64
    return v ^ (v >> 31)


def key_of(seed: int, index: int) -> int:
    return mix(mix(seed * GOLDEN + 1) + index * GOLDEN)


def uniforms(key: int, step: int, vocab: int) -> np.ndarray:
    """u[v] in (0, 1): the top 24 bits of mix(mix(key * GOLDEN + step) + v * GOLDEN), centred."""
    base = mix(key * GOLDEN + step)
    bits = [mix(base + v * GOLDEN) >> 40 for v in range(vocab)]
    return ((np.array(bits, dtype=np.float64) + 0.5) / (1 << 24)).astype(np.float32)


def nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Most likely tokens first, kept while the mass before them is below top_p (the first always)."""
    order = np.argsort(-probs, kind="stable")
    before = np.cumsum(probs[order]) - probs[order]
    keep = np.zeros(probs.shape, dtype=bool)
    keep[order[before < top_p]] = True
    return keep


def expected_token(logits: np.ndarray, key: int, step: int, temperature: float, top_p: float) -> tuple[int, float]:
    """The token the rule picks, and how far ahead of the runner-up it is (a tie in float32 arithmetic
    may go either way)."""
    scaled = logits.astype(np.float32) / np.float32(temperature)
    score = scaled + -np.log(-np.log(uniforms(key, step, logits.shape[-1])))
    if top_p < 1.0:
        p = np.exp(scaled - scaled.max())
        score = np.where(nucleus(p / p.sum(), top_p), score, -np.inf)
    order = np.argsort(-score)
    return int(order[0]), float(score[order[0]] - score[order[1]])


LENGTHS = [5, 2, 9, 3, 7, 4]
LIMITS = [3, 9, 2, 5, 1, 21]  # ragged; the longest in the highest slot: compaction moves it down


@pytest.fixture
def moves(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(src, dst) of every slot move of the decode runner (the real move runs)."""
    seen: list[tuple[int, int]] = []
    real = graphs.DecodeRunner.move

    def spy(self, src: int, dst: int) -> None:  # type: ignore[no-untyped-def]
        seen.append((src, dst))
        real(self, src, dst)

    monkeypatch.setattr(graphs.DecodeRunner, "move", spy)
    return seen


@pytest.mark.parametrize(
    ("temperature", "top_p", "seed"), [(0.8, 1.0, 5), (1.3, 0.7, 123456789), (0.05, 0.5, 77), (1.0, 0.001, 8)]
)
def test_every_sampled_token_is_the_rule_applied_to_its_logits(shards, moves, temperature, top_p, seed) -> None:
    with Runtime(shards("tiny", 1, 1, seed=11), backend="torch") as rt:
        g = torch.Generator().manual_seed(3)
        prompts = [torch.randint(3, rt.config.vocab_size, (n,), generator=g).tolist() for n in LENGTHS]
        out = rt.generate(
            prompts, LIMITS, temperature=temperature, top_p=top_p, seed=seed, return_logits=True, sync_every=2
        )
    assert moves, "no slot was compacted: the test does not reach the code it is about"
    assert [len(t) for t in out.tokens] == LIMITS
    checked = 0
    for i, (tokens, logits) in enumerate(zip(out.tokens, out.logits, strict=True)):
        assert logits.shape[0] == len(tokens)
        for step, token in enumerate(tokens):
            want, margin = expected_token(logits[step].numpy(), key_of(seed, i), step, temperature, top_p)
            if margin > 1e-4:
                assert token == want, f"request {i} step {step}: sampled {token}, the rule gives {want}"
                checked += 1
    assert checked >= 0.9 * sum(LIMITS)


def test_a_request_samples_the_same_alone_and_in_any_batch(shards) -> None:
    """Its key is (seed, request key): alone (as request key 5), or in the middle of a batch whose
    other requests finish early and get compacted away, the same tokens."""
    with Runtime(shards("tiny", 1, 1, seed=11), backend="torch") as rt:
        g = torch.Generator().manual_seed(4)
        prompts = [torch.randint(3, rt.config.vocab_size, (n,), generator=g).tolist() for n in LENGTHS]
        batch = rt.generate(prompts, LIMITS, temperature=1.0, seed=9, sync_every=3).tokens
        alone = rt.generate([prompts[5]], [LIMITS[5]], temperature=1.0, seed=9, request_keys=[5]).tokens[0]
        late = rt.generate(prompts[3:], LIMITS[3:], temperature=1.0, seed=9, request_keys=[3, 4, 5], max_batch=2)
        other = rt.generate([prompts[5]], [LIMITS[5]], temperature=1.0, seed=9, request_keys=[6]).tokens[0]
    assert alone == batch[5] == late.tokens[2]
    assert other != alone  # the key is what makes the stream: another key, other tokens
