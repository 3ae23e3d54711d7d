"""The runtime on shards against the second, independent forward (tests/model/independent.py),
not only against `plamo2_tools.model.plamo2.reference`.

The reference forward, the converter and the runtime share plamo2_tools.model.plamo2.config (norm offsets,
eps, RoPE base, layer kinds): a wrong constant there moves all three together, and comparing the
runtime with the reference cannot see it.  The independent forward spells PLaMo 2 out again from
the spec, importing nothing from plamo2_tools, so such a constant shows up here.
"""

from __future__ import annotations

import independent as ind  # tests/model/independent.py (on pytest's pythonpath)
import pytest
import torch

from plamo2_tools.model.registry import valid_layouts
from plamo2_tools.model.synth import preset_config
from plamo2_tools.runtime.batching.engine import Runtime

STEPS = 8  # greedy tokens compared per prompt (each one a full float64 forward of the independent model)
MAX_REL_ERR = 1e-4  # the fp32 threshold of `verify` (runtime/verify.py THRESHOLDS)


def layouts(preset: str) -> list[tuple[int, int]]:
    """TP1xPP1 and the largest valid split of at most 4 ranks, TP and PP together where the preset
    allows it: the one-rank path and the tensor- and pipeline-parallel paths of the runtime."""
    cfg = preset_config(preset)
    valid = [(tp, pp) for tp, pp in valid_layouts(cfg, 4, (1, 2, 4)) if pp <= 4]
    return sorted({(1, 1), max(valid, key=lambda x: (x[0] * x[1], min(x), x[0]))})


CASES = [(p, tp, pp) for p in ("tiny", "tiny-gqa", "tiny-edge") for tp, pp in layouts(p)]


@pytest.fixture(scope="module")
def independent(checkpoint, prompts: dict[str, list[list[int]]]):
    """Per preset: the independent model's float64 logits of every prompt position, and its greedy
    continuation with the logits of each step (a full forward over prompt + tokens so far)."""
    cache: dict[str, tuple[list[torch.Tensor], list[list[int]]]] = {}

    def get(preset: str) -> tuple[list[torch.Tensor], list[list[int]]]:
        if preset not in cache:
            m = ind.load(checkpoint(preset, seed=11), torch.float64)
            logits, greedy = [], []
            for prompt in prompts[preset]:
                logits.append(ind.logits(m, prompt))
                seq = list(prompt)
                for _ in range(STEPS):
                    seq.append(int(ind.logits(m, seq)[-1].argmax()))
                greedy.append(seq[len(prompt) :])
            cache[preset] = logits, greedy
        return cache[preset]

    return get


@pytest.mark.parametrize(("preset", "tp", "pp"), CASES, ids=[f"{p}-tp{t}-pp{q}" for p, t, q in CASES])
def test_runtime_matches_the_independent_forward(preset, tp, pp, shards, prompts, independent) -> None:
    """fp32 shards: every prompt position within fp32 rounding of the float64 independent logits, and
    the same greedy tokens."""
    want_logits, want_tokens = independent(preset)
    with Runtime(shards(preset, tp, pp, seed=11), backend="torch", mode="local") as rt:
        got_logits = rt.prompt_logits(prompts[preset])
        got_tokens = rt.generate(prompts[preset], STEPS).tokens
    for i, (got, want) in enumerate(zip(got_logits, want_logits, strict=True)):
        rel = ((got.double() - want).abs().max() / want.abs().max()).item()
        assert rel < MAX_REL_ERR, f"prompt {i}: max relative logit error {rel:.2e}"
    assert got_tokens == want_tokens
