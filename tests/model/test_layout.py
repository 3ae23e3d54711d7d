"""Every rank's tensors, values included, against the spec table (docs/model.md §4,
docs/shard-format.md), for every tiny preset and every valid TP x PP split.

The checkpoints are watermarked (each element encodes its own coordinates, exact in float32), so
a swapped z/x half, q/k/v piece, gate/up half, head order or wrong KV head cannot go unnoticed;
the expectation is computed in the test with plain torch slicing (convert_expect.expected_rank).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from convert_expect import (
    Watermark,
    assert_same_tensors,
    expected_rank,
    file_metadata,
    load_hf,
    load_rank,
    stage_ranges,
    vllm_pp_counts,
)

from plamo2_tools import __version__
from plamo2_tools.model.plamo2.config import Plamo2Config
from plamo2_tools.model.plamo2.presets import PRESETS
from plamo2_tools.model.synth import preset_config
from plamo2_tools.shards.manifest import MANIFEST_NAME

# Every valid split of the issue: tp in {1, 2, 4 where valid, 8 for 1 < Hkv < tp} x pp in {1, 2, 3}
# where valid.  tiny: Hq=4 (tp<=4), L=4.  tiny-gqa: Hq=8, Hkv=2 (tp 4 and 8 replicate KV heads),
# L=5.  tiny-edge: Hq=2 (tp<=2), L=2 (pp<=2).
COMBOS = (
    [("tiny", tp, pp) for tp in (1, 2, 4) for pp in (1, 2, 3)]
    + [("tiny-gqa", tp, pp) for tp in (1, 2, 4, 8) for pp in (1, 2, 3)]
    + [("tiny-edge", tp, pp) for tp in (1, 2) for pp in (1, 2)]
)


@pytest.mark.parametrize(("preset", "tp", "pp"), COMBOS, ids=[f"{p}-tp{t}-pp{q}" for p, t, q in COMBOS])
def test_every_rank_matches_the_spec(shards, checkpoint, preset: str, tp: int, pp: int) -> None:
    out = shards(preset, tp, pp, values="watermark")
    cfg = preset_config(preset)
    hf = load_hf(checkpoint(preset, values="watermark"))
    stages = stage_ranges(vllm_pp_counts(cfg.num_hidden_layers, pp))
    names = sorted(p.name for p in out.glob("*.safetensors"))
    assert names == sorted(f"model-rank-{r}-part-0.safetensors" for r in range(tp * pp))
    for rank in range(tp * pp):
        want = expected_rank(hf, cfg, tp, stages, rank)
        assert_same_tensors(load_rank(out, rank), want, f"{preset} tp={tp} pp={pp} rank {rank}", Watermark(cfg).decode)
        meta = file_metadata(out / f"model-rank-{rank}-part-0.safetensors")
        assert meta == {
            "format": "pt",
            "plamo2_tools_version": __version__,
            "tp_rank": str(rank % tp),
            "tp_size": str(tp),
            "pp_rank": str(rank // tp),
            "pp_size": str(pp),
        }
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["mapping"]["stages"] == [[s.start, s.stop] for s in stages]
    assert [(r["tp_rank"], r["pp_rank"]) for r in manifest["mapping"]["ranks"]] == [
        (r % tp, r // tp) for r in range(tp * pp)
    ]


def test_pp_split_follows_vllm_get_pp_indices() -> None:
    """The examples of docs/model.md §4, through the converter's plan (not our helper)."""
    from plamo2_tools.model import family_of
    from plamo2_tools.model.layout import make_mapping

    examples = {
        (16, 2): [8, 8],
        (16, 3): [5, 6, 5],
        (16, 4): [4, 4, 4, 4],
        (32, 3): [11, 11, 10],
        (32, 5): [6, 6, 7, 7, 6],
        (32, 6): [5, 5, 5, 6, 6, 5],
        (16, 5): [3, 3, 3, 4, 3],
        (5, 3): [2, 2, 1],
        (4, 3): [1, 2, 1],
    }
    for (layers, pp), counts in examples.items():
        cfg = Plamo2Config.from_dict({"model_type": "plamo2", **PRESETS["plamo-2-1b"], "num_hidden_layers": layers})
        stages = make_mapping(family_of(cfg), cfg, 1, pp).stages
        assert [b - a for a, b in stages] == counts, (layers, pp)
        assert vllm_pp_counts(layers, pp) == counts  # keeps the test's own helper honest


def test_pp_layers_override(shards, checkpoint) -> None:
    """--pp-layers 1,3,1 replaces vLLM's default [2,2,1] split, like VLLM_PP_LAYER_PARTITION."""
    out = shards("tiny-gqa", 2, 3, "--pp-layers", "1,3,1", values="watermark")
    cfg = preset_config("tiny-gqa")
    hf = load_hf(checkpoint("tiny-gqa", values="watermark"))
    stages = stage_ranges([1, 3, 1])
    for rank in range(6):
        assert_same_tensors(load_rank(out, rank), expected_rank(hf, cfg, 2, stages, rank), f"rank {rank}")
    layers = {r: sorted({int(k.split(".")[3]) for k in load_rank(out, r) if ".layers.layers." in k}) for r in (0, 2, 4)}
    assert layers == {0: [0], 2: [1, 2, 3], 4: [4]}  # global indices, not restarted per stage


@pytest.mark.parametrize(
    ("preset", "pp", "rank_keys"),
    [
        # tied, PP=1: vLLM's state_dict keeps only the lexicographically smaller alias, lm_head
        ("tiny", 1, {0: {"lm_head.weight"}}),
        # tied, PP>1: the embedding on the first stage, the head on the last (same rows twice)
        ("tiny", 2, {0: {"model.embed_tokens.weight"}, 1: {"lm_head.weight"}}),
        ("tiny", 3, {0: {"model.embed_tokens.weight"}, 1: set(), 2: {"lm_head.weight"}}),
        # untied: embedding first, head last
        ("tiny-gqa", 1, {0: {"model.embed_tokens.weight", "lm_head.weight"}}),
        ("tiny-gqa", 2, {0: {"model.embed_tokens.weight"}, 1: {"lm_head.weight"}}),
    ],
)
def test_embedding_and_head_keys(shards, preset: str, pp: int, rank_keys: dict[int, set[str]]) -> None:
    out = shards(preset, 1, pp, values="watermark")
    for rank, keys in rank_keys.items():
        got = set(load_rank(out, rank))
        assert got & {"model.embed_tokens.weight", "lm_head.weight"} == keys, rank
        assert ("model.norm.weight" in got) == (rank == pp - 1)


def test_vocab_padding_and_kv_replication_spelled_out(shards, checkpoint) -> None:
    """The two rules most often got wrong, with literal numbers for tiny-gqa at tp=8 (V=515 ->
    Vp=576, 72 rows per rank; Hkv=2 -> each KV head on 4 consecutive ranks)."""
    out = shards("tiny-gqa", 8, 1, values="watermark")
    hf = load_hf(checkpoint("tiny-gqa", values="watermark"))
    d, Hq = 16, 8
    for rank in range(8):
        t = load_rank(out, rank)
        head = hf["lm_head.weight"]
        assert t["lm_head.weight"].shape == (72, 96)
        real = max(0, min(72, 515 - 72 * rank))
        assert torch.equal(t["lm_head.weight"][:real], head[72 * rank : 72 * rank + real])
        assert not t["lm_head.weight"][real:].any(), f"rank {rank}: padding rows must be zero"
        g = rank // 4
        qkv = hf["model.layers.layers.1.mixer.qkv_proj.weight"]
        mine = t["model.layers.layers.1.mixer.qkv_proj.weight"]
        assert torch.equal(mine[:d], qkv[rank * d : (rank + 1) * d])  # q head = rank
        assert torch.equal(mine[d : 2 * d], qkv[(Hq + g) * d : (Hq + g + 1) * d])  # k head g
        assert torch.equal(mine[2 * d :], qkv[(Hq + 2 + g) * d : (Hq + 2 + g + 1) * d])  # v head g
        k_norm = hf["model.layers.layers.1.mixer.k_weight"][g : g + 1]  # follows the KV head, not row `rank`
        assert torch.equal(t["model.layers.layers.1.mixer.k_norm.weight"], k_norm)


@pytest.mark.parametrize(
    ("src_dtype", "out_dtype", "want"),
    [
        (torch.float32, "bfloat16", torch.bfloat16),
        (torch.float32, "float16", torch.float16),
        (torch.bfloat16, "auto", torch.bfloat16),
        (torch.bfloat16, "float32", torch.float32),
    ],
)
def test_dtype_cast_with_norms_rounded_once(shards, checkpoint, src_dtype, out_dtype, want) -> None:
    """Cast tensors are the source rounded once; offset norms are added in float32 and then
    rounded once (not rounded, added, rounded again); A stays float32 whatever the dtype."""
    out = shards("tiny-gqa", 2, 2, dtype=out_dtype, seed=1, source_dtype=src_dtype)
    cfg = preset_config("tiny-gqa")
    hf = load_hf(checkpoint("tiny-gqa", seed=1, dtype=src_dtype))
    stages = stage_ranges(vllm_pp_counts(cfg.num_hidden_layers, 2))
    twice_rounded = 0
    for rank in range(4):
        got = load_rank(out, rank)
        assert_same_tensors(got, expected_rank(hf, cfg, 2, stages, rank, want), f"rank {rank}")
        fp32 = ("mixer.A", "_scale")  # A and vLLM's attention scale buffers are float32 whatever the dtype
        assert all(t.dtype == (torch.float32 if k.endswith(fp32) else want) for k, t in got.items())
        norm = "model.layers.layers.0.post_mlp_norm.weight"
        if norm in got:
            twice_rounded += int(not torch.equal(got[norm], (hf[norm].to(want).float() + 1 / 5**1.5).to(want)))
    if torch.finfo(want).bits < torch.finfo(src_dtype).bits:  # the test can tell the roundings apart
        assert twice_rounded, "the random values do not distinguish single from double rounding"


def test_transformed_values_spelled_out(shards, checkpoint) -> None:
    """A = -exp(A_log) in float32 and the five offsets, as literal formulas on one rank."""
    out = shards("tiny", 2, 1, values="watermark")
    hf = load_hf(checkpoint("tiny", values="watermark"))
    t = load_rank(out, 1)
    p = "model.layers.layers.0."
    assert torch.equal(t[p + "mixer.A"], -torch.exp(hf[p + "mixer.A_log"][4:8].float()))
    for norm, off in (
        ("pre_mixer_norm", 1.0),
        ("post_mixer_norm", 0.2),
        ("pre_mlp_norm", 1.0),
        ("post_mlp_norm", 0.08944271909999159),
    ):
        assert torch.equal(t[p + norm + ".weight"], hf[p + norm + ".weight"] + torch.tensor(off, dtype=torch.float32))
    assert torch.equal(t["model.norm.weight"], hf["model.norm.weight"] + 1.0)
    for n in ("dt", "B", "C"):  # renamed, no offset
        assert torch.equal(t[p + f"mixer.{n}_norm.weight"], hf[p + f"mixer.{n}_norm_weight"])
    assert math.isclose(0.08944271909999159, 1 / 5**1.5)
