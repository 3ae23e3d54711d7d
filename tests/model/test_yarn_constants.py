"""YaRN's constants (issue 34, class 2): PLaMo 3's RoPE frequencies and magnitude (`model/plamo3/rope.py`) and the
forwards that use them (the reference and the runtime), against formulations that share no code with them.

1. The paper's own terms, written here: frequency i turns r_i = L0 * theta^(-2i/d) / (2 pi) times over the
   original context L0.  Dimensions that turn more than beta_fast times keep their frequency, those that turn
   fewer than beta_slow times are divided by the factor f, and between them the weight of the divided frequency
   is ln(beta_fast / r_i) / ln(beta_fast / beta_slow) (the implementations' ramp, linear in i between the two
   correction dimensions, is exactly this when both lie inside the head and are not rounded); cos and sin are
   scaled by 0.1 ln f + 1 (YaRN's attention factor, sqrt(1/t) of the paper).  Checked on real-shaped heads
   (d 64..256, theta 1e4..1e7, L0 256..64K), where the ramp spans many dimensions: the tiny3-yarn preset's
   head of 4 frequencies has a ramp that is nearly a step, which hid a wrong 2 pi.
2. Hugging Face transformers' `_compute_yarn_parameters` (the installed package, float32): vLLM's and PFN's
   formula, including the clamps and `truncate` (docs/plamo3.md 4.4), on random configurations.
3. tests/model/plamo3_independent.py (frequency by frequency in Python floats) for the forward: a checkpoint
   whose YaRN ramp covers most of the head, prompts running past L0 and past L0 * f, reference and runtime.

Seen red on bench/mutants.py's `yarn-*` mutants: the 2 pi dropped from the rotation count, the ramp reversed,
beta_fast and beta_slow swapped, the magnitude (mscale) dropped or made ln f / 10 without the 1, the factor
multiplied instead of divided, truncation applied when the config says not to.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from plamo2_tools.model.plamo3 import reference
from plamo2_tools.model.plamo3.config import Rope
from plamo2_tools.model.plamo3.rope import inv_freq

RNG = torch.Generator().manual_seed(34)


def yarn(theta: float, factor: float, original: int, truncate: bool = False) -> Rope:
    return Rope(
        theta=theta,
        yarn_factor=factor,
        original_max_positions=original,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=truncate,
    )


def paper_frequencies(
    d: int, theta: float, factor: float, original: int, fast: float = 32.0, slow: float = 1.0
) -> list[float]:
    """YaRN in rotations (see the module doc); valid when both correction dimensions lie in [0, d - 1]."""
    out = []
    for i in range(d // 2):
        omega = theta ** (-2 * i / d)
        turns = original * omega / (2 * math.pi)
        weight = min(max(math.log(fast / turns) / math.log(fast / slow), 0.0), 1.0)  # of the divided frequency
        out.append(omega * (1 - weight) + omega / factor * weight)
    return out


def inside_the_head(d: int, theta: float, original: int, fast: float = 32.0, slow: float = 1.0) -> bool:
    """Both correction dimensions in [0, d - 1]: where the turns r_i = fast and r_i = slow fall inside."""
    turns = [original * theta ** (-2 * i / d) / (2 * math.pi) for i in range(d)]  # i over the whole head
    return turns[0] >= fast and turns[d - 1] <= slow


REAL_SHAPES = [  # (head dim, theta, L0, factor): PLaMo 3's and other released models' shapes
    (128, 1e6, 4096, 4.0),
    (128, 1e6, 4096, 64.0),
    (128, 150_000.0, 2048, 8.0),
    (64, 1e4, 2048, 4.0),
    (256, 1e7, 65536, 2.0),
    (128, 5e5, 8192, 16.0),
    (96, 1e6, 32768, 40.0),
]


@pytest.mark.parametrize(("d", "theta", "original", "factor"), REAL_SHAPES)
def test_frequencies_are_the_papers_on_real_shapes(d: int, theta: float, original: int, factor: float) -> None:
    assert inside_the_head(d, theta, original)
    want = paper_frequencies(d, theta, factor, original)
    freqs, scale = inv_freq(d, yarn(theta, factor, original))
    assert freqs.dtype == torch.float64 and freqs.shape == (d // 2,)
    assert freqs.tolist() == pytest.approx(want, rel=1e-12)
    assert scale == pytest.approx(0.1 * math.log(factor) + 1.0, rel=1e-15)
    # the ramp really blends here: several dimensions are neither kept nor fully divided
    plain = [theta ** (-2 * i / d) for i in range(d // 2)]
    blended = [
        i
        for i, (f, p) in enumerate(zip(freqs.tolist(), plain, strict=True))
        if not math.isclose(f, p, rel_tol=1e-9) and not math.isclose(f, p / factor, rel_tol=1e-9)
    ]
    assert len(blended) >= 3, blended
    # high frequencies (many turns in L0) keep their value, low ones are divided by the factor
    assert freqs[0].item() == plain[0] and freqs[-1].item() == pytest.approx(plain[-1] / factor, rel=1e-12)


def test_random_configurations_match_the_papers_terms() -> None:
    kept = 0
    for _ in range(400):
        d = int(torch.randint(4, 129, (1,), generator=RNG)) * 2
        theta = 10 ** (4 + 3 * torch.rand(1, generator=RNG).item())
        original = int(2 ** (8 + 8 * torch.rand(1, generator=RNG).item()))
        factor = [1.5, 2.0, 4.0, 8.0, 32.0][int(torch.randint(0, 5, (1,), generator=RNG))]
        if not inside_the_head(d, theta, original):
            continue
        kept += 1
        freqs, _ = inv_freq(d, yarn(theta, factor, original))
        assert freqs.tolist() == pytest.approx(paper_frequencies(d, theta, factor, original), rel=1e-11), (
            d,
            theta,
            original,
            factor,
        )
    assert kept >= 100


def hf_yarn(d: int, rope: Rope) -> tuple[list[float], float]:
    """transformers' YaRN for one layer type (float32 frequencies, the attention factor)."""
    from transformers import PretrainedConfig
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    params = {
        "rope_type": "yarn",
        "rope_theta": rope.theta,
        "factor": rope.yarn_factor,
        "beta_fast": rope.beta_fast,
        "beta_slow": rope.beta_slow,
        "original_max_position_embeddings": rope.original_max_positions,
        "truncate": rope.truncate,
    }
    cfg = PretrainedConfig(
        hidden_size=4 * d,
        num_attention_heads=4,
        head_dim=d,
        rope_parameters=params,
        max_position_embeddings=int(rope.original_max_positions * rope.yarn_factor),
    )
    freqs, factor = _compute_yarn_parameters(cfg)
    return freqs.tolist(), float(factor)


def test_transformers_yarn_on_random_configurations_with_clamps_and_truncation() -> None:
    """Every configuration, also those whose range leaves the head (clamped, even reversed) or is rounded
    (float32 there: theta**(2i/d) in float32 is ~1e-6 off for large exponents)."""
    for n in range(200):
        d = int(torch.randint(2, 65, (1,), generator=RNG)) * 2
        theta = 10 ** (1 + 6 * torch.rand(1, generator=RNG).item())
        original = int(2 ** (2 + 16 * torch.rand(1, generator=RNG).item()))
        factor = float(int(torch.randint(2, 65, (1,), generator=RNG)))  # whole: L0 * f is a whole context
        rope = yarn(theta, factor, original, truncate=bool(n % 2))
        want, attention = hf_yarn(d, rope)
        freqs, scale = inv_freq(d, rope)
        assert freqs.tolist() == pytest.approx(want, rel=1e-5), (d, theta, original, factor, rope.truncate)
        assert scale == pytest.approx(attention, rel=1e-12)


def test_no_yarn_and_factor_one_are_plain_rope() -> None:
    for rope in (Rope(theta=1e6), yarn(1e6, 1.0, 4096)):
        freqs, scale = inv_freq(128, rope)
        assert freqs.tolist() == pytest.approx([1e6 ** (-i / 64) for i in range(64)], rel=1e-14) and scale == 1.0


def test_rotation_beyond_the_original_context_in_the_reference() -> None:
    """The reference's rotate-half RoPE with YaRN's tables at positions up to far beyond L0 * f, against cos/sin
    of each angle computed one by one from the paper's frequencies and magnitude."""
    d, theta, original, factor = 128, 1e6, 4096, 8.0
    freqs, scale = inv_freq(d, yarn(theta, factor, original))
    positions = [
        0,
        1,
        original - 1,
        original,
        original + 1,
        3 * original,
        int(original * factor) - 1,
        int(original * factor),
        10 * int(original * factor),
    ]
    x = torch.randn(len(positions), 2, d, dtype=torch.float64, generator=RNG)
    got = reference.rope(x, torch.tensor(positions), freqs, scale)
    want_f, m = paper_frequencies(d, theta, factor, original), 0.1 * math.log(factor) + 1.0
    for t, p in enumerate(positions):
        c = torch.tensor([math.cos(p * f) * m for f in want_f], dtype=torch.float64)
        s = torch.tensor([math.sin(p * f) * m for f in want_f], dtype=torch.float64)
        a, b = x[t, :, : d // 2], x[t, :, d // 2 :]
        want = torch.cat([a * c - b * s, b * c + a * s], dim=-1)
        # angles up to ~3e5 rad: float64 products p * f round differently by ~1e-11 rad
        torch.testing.assert_close(got[t], want, rtol=0, atol=1e-9, msg=f"position {p}")


# ---- the forwards ------------------------------------------------------------------------------------------------
ORIGINAL, FACTOR = 24, 4.0  # the prompts below run past L0 (24) and past L0 * f (96)


@pytest.fixture(scope="module")
def yarn_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A PLaMo 3 checkpoint whose full layers' YaRN ramp covers most of a 16-dim head: theta 20 with L0 24 puts
    the correction dimensions at 0 (clamped) and 4.3 of the head's 8 frequencies."""
    from plamo2_tools.model import config_from_dict
    from plamo2_tools.model.plamo3 import FAMILY
    from plamo2_tools.model.synth import random_tensor, write_checkpoint

    raw = FAMILY.preset_raw("tiny3") | {
        "num_hidden_layers": 2,
        "rope_theta": 20.0,
        "rope_scaling_factor": FACTOR,
        "initial_context_length": ORIGINAL,
    }
    cfg = config_from_dict(raw)
    rope = cfg.rope_full
    assert rope.is_yarn and not rope.truncate and (rope.beta_fast, rope.beta_slow) == (32.0, 1.0)
    freqs = inv_freq(cfg.head_dim, rope)[0].tolist()
    plain = [20.0 ** (-2 * i / cfg.head_dim) for i in range(cfg.head_dim // 2)]
    blended = [
        i
        for i, (f, p) in enumerate(zip(freqs, plain, strict=True))
        if not math.isclose(f, p) and not math.isclose(f, p / FACTOR)
    ]
    assert len(blended) >= 3
    path = tmp_path_factory.mktemp("yarn") / "ckpt"
    write_checkpoint(path, cfg, lambda n, s: random_tensor(cfg, n, s, 7), torch.float32, tokenizer=False)
    return path


def independent(path: Path, ids: list[int], **config_changes: object) -> torch.Tensor:
    """plamo3_independent's float64 logits of the checkpoint (its config.json with `config_changes`)."""
    from plamo3_independent import independent_logits

    from plamo2_tools.model.checkpoint import HFCheckpoint

    with HFCheckpoint(path) as ckpt:
        weights = {n: ckpt.get(n).double() for n in ckpt.tensors}
    config = json.loads((path / "config.json").read_text()) | config_changes
    return independent_logits(config, weights, ids, "hf")


def long_prompt(path: Path, n: int = 110) -> list[int]:
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(3)).tolist()


def test_reference_forward_past_the_original_context(yarn_checkpoint: Path) -> None:
    from plamo2_tools.model.checkpoint import HFCheckpoint
    from plamo2_tools.model.plamo3 import FAMILY

    ids = long_prompt(yarn_checkpoint)
    want = independent(yarn_checkpoint, ids)
    with HFCheckpoint(yarn_checkpoint) as ckpt:
        got = FAMILY.reference_logits(ckpt, [ids], torch.float64, window_convention="hf")[0]
    err = (got.double() - want).abs().max().item()
    assert err <= 1e-9 + 2e-7 * want.abs().max().item(), err
    # past L0 * f YaRN is all there is between this model and plain RoPE: the prompt must see a difference there
    plain = independent(yarn_checkpoint, ids, rope_scaling_factor=1.0, initial_context_length=None)
    tail = int(ORIGINAL * FACTOR)
    assert (plain[tail:] - want[tail:]).abs().max() > 1e-2


def test_runtime_forward_past_the_original_context(yarn_checkpoint: Path, tmp_path: Path) -> None:
    from plamo2_tools.convert.engine import convert
    from plamo2_tools.runtime.batching.engine import Runtime

    ids = long_prompt(yarn_checkpoint)
    want = independent(yarn_checkpoint, ids)
    convert(yarn_checkpoint, tmp_path / "tp2", tp=2)
    with Runtime(tmp_path / "tp2", backend="torch", mode="local") as rt:
        (got,) = rt.prompt_logits([ids])
    err = (got.double() - want).abs().max().item()
    assert err <= 1e-5 * want.abs().max().item(), err  # float32 runtime, float64 oracle (seen: 4e-7)


def test_truncation_changes_the_frequencies_where_the_range_is_fractional() -> None:
    """truncate=True rounds the range outward (floor / ceil); PFN's config says False: the two must differ on
    a real shape (so that a reader that ignores the flag is seen)."""
    rope = yarn(1e6, 8.0, 4096)
    exact, rounded = inv_freq(128, rope)[0], inv_freq(128, dataclasses.replace(rope, truncate=True))[0]
    assert (exact - rounded).abs().max() > 1e-6
