"""PLaMo 3 shards hold exactly what vLLM 0.26's Plamo3ForCausalLM holds per rank, checked against
an expectation written here straight from docs/plamo3.md §5 with plain torch slicing on the full HF
tensors (watermarked: every element names its own origin), never through the converter's table.

Break-it guards (each planted bug fails here): the q/k norms split over ranks instead of
replicated, the scale buffers dropped, KV heads not replicated when K < TP, the untied head without
vLLM's extra rows, PP stages without the embedding/norm/head."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from convert_expect import Watermark, load_hf, load_rank, vllm_pp_counts

from plamo2_tools.model import family_named
from plamo2_tools.model.layout import Piece, split_rows
from plamo2_tools.model.registry import valid_layouts
from plamo2_tools.model.synth import preset_config

# docs/plamo3.md §3, as literals (not the package's constants).
OFFSETS = {
    "pre_mixer_norm": 1.0,
    "post_mixer_norm": 0.2,
    "pre_mlp_norm": 1.0,
    "post_mlp_norm": 1 / 5**1.5,
    "mixer.q_norm": 1.0,
    "mixer.k_norm": 1.0,
}
SCALES = ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")


def pad64(n: int) -> int:
    return -(-n // 64) * 64


def expected_rank(hf: dict[str, torch.Tensor], raw: dict, tp: int, pp: int, rank: int) -> dict[str, torch.Tensor]:
    L, D, H, K, d = (
        raw[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    )
    F, V, tied = raw["intermediate_size"], raw["vocab_size"], raw.get("tie_word_embeddings", True)
    r, stage = rank % tp, rank // tp
    counts = vllm_pp_counts(L, pp)
    first = sum(counts[:stage])
    out: dict[str, torch.Tensor] = {}

    def vocab_block(table: torch.Tensor, rows: int) -> torch.Tensor:
        block = pad64(V) // tp
        got = torch.zeros(rows, D)
        lo, hi = r * block, min((r + 1) * block, V)
        if hi > lo:
            got[: hi - lo] = table[lo:hi]
        return got

    embed = hf["model.embed_tokens.weight"]
    if tied:  # one alias on every stage, saved as lm_head.weight
        out["lm_head.weight"] = vocab_block(embed, pad64(V) // tp)
    else:
        out["model.embed_tokens.weight"] = vocab_block(embed, pad64(V) // tp)
        head_rows = pad64(pad64(V) + math.ceil(V / 16) * 16 - V) // tp  # ParallelLMHead(round16(V), org=V)
        out["lm_head.weight"] = vocab_block(hf["lm_head.weight"], head_rows)
    out["model.norm.weight"] = hf["model.norm.weight"].float() + 1.0
    qh, f = H // tp, F // tp
    kv = list(range(r * K // tp, (r + 1) * K // tp)) if tp <= K else [r // (tp // K)]
    for i in range(first, first + counts[stage]):
        p = f"model.layers.layers.{i}."
        for name, off in OFFSETS.items():
            out[p + name + ".weight"] = hf[p + name + ".weight"].float() + off
        qkv = hf[p + "mixer.qkv_proj.weight"].view(H + 2 * K, d, D)
        q, k, v = qkv[:H], qkv[H : H + K], qkv[H + K :]
        out[p + "mixer.qkv_proj.weight"] = torch.cat([q[r * qh : (r + 1) * qh], k[kv], v[kv]]).reshape(-1, D)
        out[p + "mixer.o_proj.weight"] = hf[p + "mixer.o_proj.weight"][:, r * qh * d : (r + 1) * qh * d]
        gate, up = hf[p + "mlp.gate_up_proj.weight"].chunk(2)
        out[p + "mlp.gate_up_proj.weight"] = torch.cat([gate[r * f : (r + 1) * f], up[r * f : (r + 1) * f]])
        out[p + "mlp.down_proj.weight"] = hf[p + "mlp.down_proj.weight"][:, r * f : (r + 1) * f]
        for s in SCALES:
            out[p + "mixer.attn." + s] = torch.tensor(1.0)
    return out


def _raw(preset: str) -> dict:
    return family_named("plamo3").preset_raw(preset)


LAYOUTS = [
    (p, tp, pp)
    for p in ("tiny3", "tiny3-mqa", "tiny3-yarn")
    for tp, pp in valid_layouts(preset_config(p), 8)
    if pp <= 3
]


@pytest.mark.parametrize("preset, tp, pp", LAYOUTS, ids=[f"{p}-tp{t}-pp{q}" for p, t, q in LAYOUTS])
def test_every_rank_holds_what_vllm_holds(shards, checkpoint, preset: str, tp: int, pp: int) -> None:
    out = shards(preset, tp, pp, values="watermark")
    hf = load_hf(checkpoint(preset, values="watermark"))
    mark = Watermark(preset_config(preset))
    for rank in range(tp * pp):
        got, want = load_rank(out, rank), expected_rank(hf, _raw(preset), tp, pp, rank)
        assert sorted(got) == sorted(want), (rank, sorted(set(got) ^ set(want)))
        for key, w in want.items():
            g = got[key]
            assert g.dtype == torch.float32, key  # fp32 watermarks; the scale buffers are fp32 always
            assert g.shape == w.shape, (rank, key, g.shape, w.shape)
            if not torch.equal(g, w.to(g.dtype)):
                where = (g != w).nonzero()[0].tolist()
                raise AssertionError(
                    f"rank {rank} {key}{where}: {mark.decode(float(g[tuple(where)]))}, "
                    f"expected {mark.decode(float(w[tuple(where)]))}"
                )


def test_bf16_shards_fold_offsets_in_the_shard_dtype(shards, checkpoint) -> None:
    """vLLM's Plamo3 loader copies a norm weight into its bf16 parameter, then adds the offset there
    (float32 arithmetic on CUDA, rounded again): two roundings, which the shards must repeat."""
    out = shards("tiny3", 2, 1, dtype="bfloat16")
    hf = load_hf(checkpoint("tiny3"))  # float32
    rank = load_rank(out, 1)
    for name, off in (
        ("model.layers.layers.0.post_mlp_norm.weight", 1 / 5**1.5),
        ("model.layers.layers.1.mixer.q_norm.weight", 1.0),
        ("model.norm.weight", 1.0),
    ):
        got = rank[name]
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, (hf[name].to(torch.bfloat16).float() + off).to(torch.bfloat16)), name
    post_mlp = "model.layers.layers.0.post_mlp_norm.weight"
    assert not torch.equal(rank[post_mlp], (hf[post_mlp].float() + 1 / 5**1.5).to(torch.bfloat16)), "cannot tell"
    assert rank["model.layers.layers.0.mixer.attn._q_scale"].dtype == torch.float32


# ---- break-it: the expectation above catches each of these bugs in the table --------------------------
def _with_rule(hf_name: str, rule) -> tuple:  # noqa: ANN001 - a layout Rule
    from plamo2_tools.model.plamo3 import Plamo3Family

    return tuple(dataclasses.replace(k, rule=rule) if k.hf == hf_name else k for k in Plamo3Family.tensors)


def _round_robin_kv(name: str, c, tp: int, r: int):  # noqa: ANN001, ANN202
    """KV heads dealt out round-robin when K < TP (vLLM gives each block of TP/K ranks one head)."""
    H, K, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    q = H // tp
    g = r % K
    return (Piece(name, 0, r * q * d, q * d), Piece(name, 0, (H + g) * d, d), Piece(name, 0, (H + K + g) * d, d))


BUGS = {
    "q/k norms split over ranks": ("tiny3", 2, 1),
    "scale buffers dropped": ("tiny3", 1, 1),
    "KV heads replicated round-robin": ("tiny3", 4, 1),
    "untied head without vLLM's extra rows": ("tiny3-mqa", 2, 1),
    "globals on the first/last stage only (PLaMo 2's rule)": ("tiny3-mqa", 1, 3),
}


@pytest.mark.parametrize("bug", list(BUGS))
def test_planted_layout_bugs_are_caught(bug: str, checkpoint, cli, tmp_path: Path, monkeypatch) -> None:
    from plamo2_tools.model.family import Family
    from plamo2_tools.model.plamo3 import Plamo3Family
    from plamo2_tools.model.plamo3 import tensors as table

    if bug.startswith("q/k norms"):
        split = lambda name, c, tp, r: split_rows(name, c.head_dim, tp, r)  # noqa: E731
        monkeypatch.setattr(Plamo3Family, "tensors", _with_rule("mixer.q_norm.weight", split))
        monkeypatch.setattr(Plamo3Family, "tensors", _with_rule("mixer.k_norm.weight", split))
    elif bug.startswith("scale buffers"):
        monkeypatch.setattr(Plamo3Family, "extras", ())
    elif bug.startswith("KV heads"):
        monkeypatch.setattr(Plamo3Family, "tensors", _with_rule("mixer.qkv_proj.weight", _round_robin_kv))
    elif bug.startswith("untied head"):
        monkeypatch.setattr(Plamo3Family, "tensors", _with_rule("lm_head.weight", table._embedding))
    else:
        monkeypatch.setattr(Plamo3Family, "holds_globals", Family.holds_globals)
    preset, tp, pp = BUGS[bug]
    out = tmp_path / "shards"
    src = checkpoint(preset, values="watermark")
    cli("convert", src, out, "--tp", tp, "--pp", pp, "--json")
    hf = load_hf(src)

    def matches(rank: int) -> bool:
        got, want = load_rank(out, rank), expected_rank(hf, _raw(preset), tp, pp, rank)
        same_keys = sorted(got) == sorted(want)
        return same_keys and all(
            got[k].shape == w.shape and torch.equal(got[k], w.to(got[k].dtype)) for k, w in want.items()
        )

    assert not all(matches(rank) for rank in range(tp * pp)), f"{bug}: the planted bug went unnoticed"
