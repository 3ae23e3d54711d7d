"""The reference forward against the independent formulation of tests/model/independent.py
(chunked SSD, F.conv1d, SDPA with a band mask, complex RoPE, safetensors' own reader), on fresh
seeds of every tiny preset and a few custom configs, with sequences longer than the window."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import independent as ind
import pytest
import torch
from model_helpers import Checkpoint, preset_raw

from plamo2_tools.errors import UserError
from plamo2_tools.model.checkpoint import HFCheckpoint
from plamo2_tools.model.plamo2 import reference
from plamo2_tools.model.plamo_reference import layer_weights

# Hidden states are compared in float64; 1e-9 leaves room for summation order and nothing else.
TOL = 1e-9
# (preset, synth seed, token seed, SSD chunk of the independent form)
CASES = [
    ("tiny", 101, 1, 5),
    ("tiny", 102, 2, 8),
    ("tiny-gqa", 201, 3, 5),
    ("tiny-gqa", 202, 4, 7),
    ("tiny-edge", 301, 5, 4),
    ("tiny-edge", 302, 6, 16),
    ("tiny-2.1", 401, 7, 5),
    ("tiny-2.1", 402, 8, 6),
]


def random_tokens(V: int, T: int, seed: int) -> list[int]:
    toks = torch.randint(0, V, (T,), generator=torch.Generator().manual_seed(seed)).tolist()
    return [0, V - 1, *toks[2:]]  # both ends of the vocabulary


def long_tokens(path: Path, seed: int) -> list[int]:
    """A sequence more than twice the attention window."""
    m = ind.load(path)
    window = m.get("attention_window_size")
    return random_tokens(m.raw["vocab_size"], 2 * window + 5, seed)


def reference_hidden_states(ckpt: HFCheckpoint, tokens: list[int]) -> list[torch.Tensor]:
    """The reference's own layers, chained in float64: [embedding output, layer 0, ...]."""
    hs = [ckpt.get("model.embed_tokens.weight").double()[torch.tensor(tokens)]]
    for i in range(ckpt.config.num_hidden_layers):
        hs.append(reference.decoder_layer(hs[-1], layer_weights(ckpt, i, torch.float64), ckpt.config, i))
    return hs


def assert_float32_rounding_of(got: torch.Tensor, exact: torch.Tensor) -> None:
    """`got` (float32) is `exact` (float64) rounded to float32, up to TOL before the rounding.

    reference_logits computes in float64 but returns float32, so an exact comparison is only
    possible up to half a float32 ulp; any real difference in the forward is far larger."""
    assert got.dtype == torch.float32 and got.shape == exact.shape
    e32 = exact.abs().float()
    half_ulp = (torch.nextafter(e32, torch.tensor(float("inf"))) - e32).double() / 2
    excess = (got.double() - exact).abs() - half_ulp
    assert excess.max().item() <= TOL


def check_against_independent(path: Path, tokens: list[int], chunk: int) -> None:
    m = ind.load(path)
    exact_hs = ind.hidden_states(m, tokens, chunk)
    exact = ind.logits(m, tokens, chunk)
    with HFCheckpoint(path) as ckpt:
        ref_hs = reference_hidden_states(ckpt, tokens)
        got = reference.reference_logits(ckpt, [tokens], torch.float64)[0]
    for i, (r, e) in enumerate(zip(ref_hs, exact_hs, strict=True)):
        assert (r - e).abs().max().item() < TOL, f"hidden state after layer {i - 1} differs"
    assert_float32_rounding_of(got, exact)


@pytest.mark.parametrize(("preset", "seed", "tok_seed", "chunk"), CASES)
def test_reference_matches_independent_forward(
    checkpoint: Checkpoint, preset: str, seed: int, tok_seed: int, chunk: int
) -> None:
    path = checkpoint(preset, seed)
    check_against_independent(path, long_tokens(path, tok_seed), chunk)


@pytest.mark.parametrize(
    ("name", "overrides"),
    [
        # mamba_enabled false: every layer attention, one of them full causal.
        ("all-attention", dict(mamba_enabled=False, full_attention_idx=[2])),
        # L = 1 <= mamba_step // 2: the single layer is attention.
        ("one-layer", dict(num_hidden_layers=1)),
        # step 4 (M M A M M M A), GQA 4:2, one full and one windowed attention layer, other eps/theta.
        (
            "step4",
            dict(
                num_hidden_layers=7,
                mamba_step=4,
                num_key_value_heads=2,
                full_attention_idx=[2],
                rope_theta=5e5,
                rms_norm_eps=1e-5,
                tie_word_embeddings=False,
                attention_window_size=7,
            ),
        ),
        # Hkv = Hq (no grouping), d_conv 2.
        ("mha", dict(num_key_value_heads=4, mamba_d_conv=2, attention_window_size=3)),
    ],
)
def test_reference_matches_independent_custom_configs(
    custom_checkpoint: Callable[..., Path], name: str, overrides: dict
) -> None:
    path = custom_checkpoint(preset_raw("tiny", **overrides), seed=len(name))
    check_against_independent(path, long_tokens(path, len(name)), chunk=6)


def test_several_sequences_do_not_interact(checkpoint: Checkpoint) -> None:
    path = checkpoint("tiny-gqa", 203)
    V = 515
    seqs = [random_tokens(V, T, 10 + T) for T in (25, 1, 13)]
    m = ind.load(path)
    with HFCheckpoint(path) as ckpt:
        got = reference.reference_logits(ckpt, seqs)
    for seq, g in zip(seqs, got, strict=True):
        assert_float32_rounding_of(g, ind.logits(m, seq))


def test_multi_file_checkpoint_gives_the_same_logits(checkpoint: Checkpoint) -> None:
    tokens = random_tokens(1000, 30, 7)
    out = []
    for files in (1, 3):
        with HFCheckpoint(checkpoint("tiny", 104, files=files)) as ckpt:
            out.append(reference.reference_logits(ckpt, [tokens])[0])
    assert torch.equal(*out)


def test_float32_precision_is_close(checkpoint: Checkpoint) -> None:
    path = checkpoint("tiny-gqa", 204)
    tokens = long_tokens(path, 8)
    with HFCheckpoint(path) as ckpt:
        f64 = reference.reference_logits(ckpt, [tokens], torch.float64)[0]
        f32 = reference.reference_logits(ckpt, [tokens], torch.float32)[0]
    assert (f64 - f32).abs().max().item() < 1e-3


@pytest.mark.parametrize("bad", [[-1], [1000], [5, 1000000]])
def test_token_outside_vocabulary_is_a_user_error(checkpoint: Checkpoint, bad: list[int]) -> None:
    with HFCheckpoint(checkpoint("tiny")) as ckpt, pytest.raises(UserError, match="outside the vocabulary"):
        reference.reference_logits(ckpt, [[1, 2], [3, *bad]])


# ---- the comparison can tell the difference --------------------------------------------------------
# Each variant below is a plausible misreading of the spec; the independent forward with that
# misreading must disagree with the reference clearly, or the tests above would prove nothing.
def _variant_diff(path: Path, tokens: list[int], change: Callable[[ind.Model], None]) -> float:
    m = ind.load(path)
    change(m)
    with HFCheckpoint(path) as ckpt:
        ref = reference.reference_logits(ckpt, [tokens])[0].double()
    return (ind.logits(m, tokens) - ref).abs().max().item()


def test_tiled_gqa_would_be_caught(checkpoint: Checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    path = checkpoint("tiny-gqa", 201)
    monkeypatch.setattr(ind, "kv_index", lambda Hq, Hkv: torch.arange(Hq) % Hkv)
    assert _variant_diff(path, long_tokens(path, 3), lambda m: None) > 1e-3


@pytest.mark.parametrize("preset", ["tiny", "tiny-gqa", "tiny-edge", "tiny-2.1"])
def test_ignoring_the_window_would_be_caught(checkpoint: Checkpoint, preset: str) -> None:
    path = checkpoint(preset, 9)
    assert _variant_diff(path, long_tokens(path, 3), lambda m: m.raw.update(attention_window_size=10**6)) > 1e-3


def test_window_off_by_one_would_be_caught(checkpoint: Checkpoint) -> None:
    # vLLM's "window keys" instead of HF's "itself + window keys".
    path = checkpoint("tiny", 9)
    shrink = lambda m: m.raw.update(attention_window_size=m.raw["attention_window_size"] - 1)  # noqa: E731
    assert _variant_diff(path, long_tokens(path, 3), shrink) > 1e-3


def test_ignoring_full_attention_idx_would_be_caught(checkpoint: Checkpoint) -> None:
    path = checkpoint("tiny-gqa", 9)  # layer 4 is full causal
    assert _variant_diff(path, long_tokens(path, 3), lambda m: m.raw.update(full_attention_idx=[])) > 1e-3


def test_ignoring_rope_local_theta_would_be_caught(checkpoint: Checkpoint) -> None:
    """PLaMo 2.1: the windowed layers use rope_local_theta (10 vs 1e6 in tiny-2.1)."""
    path = checkpoint("tiny-2.1", 9)
    assert _variant_diff(path, long_tokens(path, 3), lambda m: m.raw.pop("rope_local_theta")) > 1e-3


def test_rope_local_theta_on_the_full_attention_layer_would_be_caught(checkpoint: Checkpoint) -> None:
    """...and the full-attention layer (3) keeps rope_theta."""
    path = checkpoint("tiny-2.1", 9)
    assert _variant_diff(path, long_tokens(path, 3), lambda m: m.raw.update(rope_theta=10.0)) > 1e-3
