"""`export mlx` against mlx-lm itself: the directory loads with `mlx_lm.load` (its strict loader:
every name and shape as its model class holds them), its logits equal the float64 reference within
float32 rounding, every quantized tensor is what `mlx.core.quantize` makes of the source tensor,
and the divergences this mlx-lm (0.32.2) really has are found, at the position they start.

Shown to fail (each broken on purpose, seen red, restored):
* conv1d written in the HF shape [C, 1, K] without the family's shape: mlx-lm's sanitize fixes it
  itself, so the load passes, but the bit-for-bit test fails on the shape (by design we store what
  mlx_lm.convert stores);
* an untied PLaMo 2 head written with its padded rows: mlx_lm.load refuses (tiny-gqa);
* `mlx_config` of PLaMo 3 without the flat RoPE keys: the v5-form checkpoint (V5_PLAIN) diverges
  (mlx-lm falls back to its own RoPE bases, 1e6 and 1e4);
* the quantized bias rounded with `+ 1` ulp: the bit-for-bit test fails;
* the PLaMo 2 RoPE difference removed from `differences`: test_rope_base_difference fails.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.mlx

WIDE = {"attention_window_size": 4096}  # PLaMo 2 with no window mlx-lm could miss on these prompts
# PLaMo 3 in the transformers-v5 form (rope_parameters per layer type, no flat keys), without YaRN.
V5_PLAIN = {
    "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
    }
}


def export(cli, src: Path, out: Path, *args: object, expect: int = 0) -> dict:  # noqa: ANN001
    r = cli("export", "mlx", src, out, *args, "--json", expect=expect)
    return json.loads(r.stdout)


def reference_logprobs(src: Path, seqs: list[list[int]], **options: object) -> list[np.ndarray]:
    import torch

    from plamo2_tools.deploy.compare import log_softmax
    from plamo2_tools.model.checkpoint import HFCheckpoint

    with HFCheckpoint(src) as ckpt:
        logits = ckpt.family.reference_logits(ckpt, seqs, torch.float64, "cpu", **options)
    return [log_softmax(lg.double().numpy()) for lg in logits]


@pytest.mark.parametrize(
    ("preset", "overrides"),
    [("tiny", WIDE), ("tiny-gqa", {}), ("tiny-2.1", {}), ("tiny3", {}), ("tiny3-mqa", {}), ("tiny3-yarn", {})],
)
def test_loads_with_mlx_lm_load(cli, plamo_checkpoint, tmp_path: Path, preset: str, overrides: dict) -> None:  # noqa: ANN001
    """The real entry point, tokenizer included (through the checkpoint's tokenization_plamo.py,
    here a stand-in over our native tokenizer: see conftest.TOKENIZER_SHIM)."""
    import mlx_lm

    from plamo2_tools.tokenizer import load_native

    src = plamo_checkpoint(preset, shim=True, **overrides)
    out = tmp_path / "mlx"
    record = export(cli, src, out, "--no-verify")
    assert record["files"] == ["model.safetensors"] and (out / "tokenization_plamo.py").is_file()
    model, tokenizer = mlx_lm.load(str(out), tokenizer_config={"trust_remote_code": True})
    family = "plamo3" if preset.startswith("tiny3") else "plamo2"
    assert type(model).__module__ == f"mlx_lm.models.{family}"
    text = "Hello, PLaMo! 1+1=2"
    assert tokenizer.encode(text) == load_native(src)(text)["input_ids"]


@pytest.mark.parametrize(
    ("preset", "overrides"), [("tiny", WIDE), ("tiny3", {}), ("tiny3-mqa", {}), ("tiny3-yarn", V5_PLAIN)]
)
def test_float32_logits_equal_the_reference(
    cli, plamo_checkpoint, tmp_path: Path, preset: str, overrides: dict
) -> None:  # noqa: ANN001, E501
    """fp32 export: mlx-lm in float32 against our float64 reference (its logits rounded to float32).
    Bound: max |Δlogit| <= 1e-4 of the largest |logit| and KL <= 1e-6 per position.  Float32
    rounding over these few layers is ~1e-6 relative (measured: KL ~1e-10 mean); a single tensor in
    the wrong layout or order moves logits by O(1) and KL by >= 1e-3 (the RoPE base alone: 1e-4)."""
    from plamo2_tools.deploy.mlx import MLXTarget
    from plamo2_tools.export.verified import fixed_prompts

    src = plamo_checkpoint(preset, **overrides)
    out = tmp_path / "mlx"
    export(cli, src, out, "--no-verify")
    target = MLXTarget(str(out))
    cfg = target.config
    prompts = fixed_prompts(cfg.vocab_size, cfg.bos_token_id, count=3, lengths=(5, 12))  # inside every window
    refs = reference_logprobs(src, prompts)
    for p, s, ref in zip(prompts, target.score(prompts), refs, strict=True):
        r = ref[: len(p) - 1]
        kl = (np.exp(r) * (r - s.logprobs)).sum(-1)
        assert kl.max() <= 1e-6, kl.max()
        assert np.abs(s.logprobs - r).max() <= 1e-4 * np.abs(r).max()


def test_the_dt_clamp_is_the_difference_left_on_tiny_gqa(
    cli, plamo_checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:  # noqa: ANN001
    """tiny-gqa with RoPE base 10000 and a wide window still differs from the reference: mlx-lm
    clamps the Mamba time step to [0.001, 100] (ssm_update's default) and synth's dt leaves that
    range.  Run with the clamp lifted (what PFN's loader does: time_step_limit=(0, inf)) the same
    export agrees to float32 rounding: the export is right, the clamp is mlx-lm's."""
    import mlx_lm.models.plamo2 as plamo2
    import mlx_lm.models.ssm as ssm

    from plamo2_tools.deploy.mlx import MLXTarget
    from plamo2_tools.export.verified import fixed_prompts

    src = plamo_checkpoint("tiny-gqa", **WIDE, rope_theta=10000.0)
    out = tmp_path / "mlx"
    export(cli, src, out, "--no-verify")
    target = MLXTarget(str(out))
    prompts = fixed_prompts(target.config.vocab_size, 1, count=3, lengths=(5, 12))
    refs = reference_logprobs(src, prompts)

    def max_kl() -> float:
        return max(
            float((np.exp(r[: len(p) - 1]) * (r[: len(p) - 1] - s.logprobs)).sum(-1).max())
            for p, s, r in zip(prompts, target.score(prompts), refs, strict=True)
        )

    stock = max_kl()
    real = ssm.ssm_update
    monkeypatch.setattr(plamo2, "ssm_update", lambda *a, **k: real(*a, **{**k, "time_step_limit": (0.0, np.inf)}))
    unclamped = max_kl()
    assert unclamped <= 1e-9, unclamped
    assert stock > 100 * max(unclamped, 1e-12), (stock, unclamped)


def _load(path: Path) -> dict:
    import mlx.core as mx

    out: dict = {}
    for f in sorted(path.glob("model*.safetensors")):
        out.update(mx.load(str(f)))
    return out


@pytest.mark.parametrize(
    ("preset", "dtype", "args"),
    [
        ("tiny", "float32", ("--bits", 4, "--group-size", 32)),
        ("tiny", "bfloat16", ("--bits", 8, "--mixed")),
        ("tiny-gqa", "float32", ("--bits", 4, "--mixed", "--group-size", 32, "--dtype", "float16")),
        ("tiny3-mqa", "bfloat16", ("--bits", 4, "--group-size", 32, "--max-part-size", "20kB")),
    ],
)
def test_quantized_tensors_are_mlx_quantize_of_the_source(
    cli, plamo_checkpoint, tmp_path: Path, preset: str, dtype: str, args: tuple
) -> None:  # noqa: ANN001
    """Every exported tensor re-derived with MLX from the source file (read by mx.load, cast with
    MLX's astype, quantized by mx.quantize with the group size and bits the config gives that
    module): the bytes are equal; every unquantized one equals the source's bytes."""
    import mlx.core as mx

    src = plamo_checkpoint(preset, dtype=dtype)
    out = tmp_path / "mlx"
    record = export(cli, src, out, *args, "--no-verify")
    config = json.loads((out / "config.json").read_text())
    quant = config["quantization"]
    assert config["quantization_config"] == quant
    want = mx.float16 if "float16" in args else None  # the --dtype cast, as MLX's astype makes it
    source, exported = _load(src), _load(out)
    seen = set()
    for name, w in source.items():
        module = name.removesuffix(".weight")
        if want is not None:
            w = w.astype(want)
        if name == "lm_head.weight" and preset.startswith("tiny") and not preset.startswith("tiny3"):
            w = w[: config["vocab_size"]]
        if name.endswith("conv1d.weight"):
            w = w.moveaxis(2, 1)
        setting = quant.get(module, None if f"{module}.scales" not in exported else quant)
        if f"{module}.scales" in exported:
            gs, bits = setting["group_size"], setting["bits"]
            ref = mx.quantize(w, group_size=gs, bits=bits)
            for part, r in zip(("weight", "scales", "biases"), ref, strict=True):
                got = exported[f"{module}.{part}"]
                assert got.dtype == r.dtype and got.shape == r.shape, (name, part)
                assert mx.array_equal(got, r).item(), f"{module}.{part} differs from mx.quantize"
                seen.add(f"{module}.{part}")
        else:
            assert setting in (None, False) or module not in quant, name
            got = exported[name]
            assert got.dtype == w.dtype and got.shape == w.shape, name
            assert mx.array_equal(got, w).item(), name
            seen.add(name)
    assert seen == set(exported), set(exported) ^ seen
    assert record["quantized_tensors"] > 0
    if "--max-part-size" in args:
        assert len(record["files"]) > 1 and (out / "model.safetensors.index.json").is_file()


def test_mixed_keeps_plamo2_s_ssm_tensors_and_puts_the_mlps_at_bits(cli, plamo_checkpoint, tmp_path: Path) -> None:  # noqa: ANN001
    src = plamo_checkpoint("tiny", **WIDE)
    out = tmp_path / "mlx"
    export(cli, src, out, "--bits", 4, "--mixed", "--group-size", 32, "--no-verify")
    quant = json.loads((out / "config.json").read_text())["quantization"]
    layer0 = "model.layers.layers.0."  # a Mamba layer; 1 is attention
    for kept in ("mixer.bcdt_proj", "mixer.dt_proj", "mixer.out_proj"):
        assert quant[layer0 + kept] is False
    assert layer0 + "mlp.gate_up_proj" not in quant  # the default: --bits
    assert quant[layer0 + "mixer.in_proj"] == {"group_size": 32, "bits": 8}
    assert quant["model.layers.layers.1.mixer.qkv_proj"] == {"group_size": 32, "bits": 8}
    assert (quant["bits"], quant["group_size"], quant["mode"]) == (4, 32, "affine")


# ---- the verification that ends an export -----------------------------------------------------------
def test_an_exact_export_passes_and_records_its_figures(cli, plamo_checkpoint, tmp_path: Path) -> None:  # noqa: ANN001
    src = plamo_checkpoint("tiny", **WIDE)
    out = tmp_path / "mlx"
    record = export(cli, src, out)
    v = record["verification"]
    t = v["targets"][0]  # `verify`'s own result (deploy/verify.py), judged by the float32 thresholds
    run = t["conventions"]["default"]
    assert v["passed"] and t["precision"] == "float32" and run["first_divergence"] is None
    assert run["teacher_forced"]["mean_kl"] < 1e-8 and run["greedy"]["match_fraction"] == 1.0
    assert json.loads((out / "plamo2_export.json").read_text())["verification"]["passed"]
    assert t["info"]["versions"]["mlx_lm"] == "0.32.2" and t["kind"] == "mlx"


def test_rope_base_difference_is_found_at_position_1(cli, plamo_checkpoint, tmp_path: Path, one_line_error) -> None:  # noqa: ANN001
    """mlx-lm 0.32.2's PLaMo 2 uses RoPE base 10000 whatever rope_theta says: tiny-gqa (1e6) with a
    wide window diverges at position 1 (position 0 attends to itself only, where RoPE cancels);
    the same checkpoint with rope_theta 10000 passes (test_float32_logits_equal_the_reference)."""
    src = plamo_checkpoint("tiny-gqa", **WIDE)
    out = tmp_path / "mlx"
    r = cli("export", "mlx", src, out, "--json", expect=1)
    line = one_line_error(r, 1)
    assert "mlx-lm's output differs" in line and "position 1" in line
    record = json.loads(r.stdout)
    assert [d["key"] for d in record["known_differences"]][:1] == ["rope_base"]
    first = record["verification"]["targets"][0]["first_divergence"]
    assert first["position"] == 1 and first["phase"] == "teacher-forced"
    assert (out / "config.json").is_file()  # the export is sound: the divergence is mlx-lm's


def test_missing_sliding_window_diverges_just_past_the_window(cli, plamo_checkpoint, tmp_path: Path) -> None:  # noqa: ANN001
    """tiny's window is 12: mlx-lm 0.32.2 attends to every earlier token, so the first position
    that differs is 13 (the first whose window excludes a key) in a prompt longer than that."""
    src = plamo_checkpoint("tiny")
    out = tmp_path / "mlx"
    record = export(cli, src, out, expect=1)
    assert "sliding_window" in [d["key"] for d in record["known_differences"]]
    series = record["verification"]["targets"][0]["conventions"]["default"]["positions"]
    firsts = {s["prompt"]: min(s["divergent"]) for s in series if s["phase"] == "teacher-forced" and s["divergent"]}
    assert set(firsts.values()) == {13}
    lengths = record["verification"]["prompts"]["lengths"]
    assert all(lengths[p] > 14 for p in firsts)


def test_a_geometry_mlx_lm_cannot_run_is_a_failed_verification(
    cli, plamo_checkpoint, tmp_path: Path, one_line_error
) -> None:  # noqa: ANN001
    """tiny-edge (2 layers, mamba_step 5): mlx-lm's decoder indexes its caches at mamba_step // 2."""
    out = tmp_path / "mlx"
    r = cli("export", "mlx", plamo_checkpoint("tiny-edge"), out, "--json", expect=1)
    assert "IndexError" in one_line_error(r, 1)
    record = json.loads(r.stdout)
    assert record["known_differences"][0]["key"] == "does_not_run"
    assert not record["verification"]["passed"] and "IndexError" in record["verification"]["error"]


def test_plamo3_scores_with_the_hf_window_and_decodes_with_the_vllm_one(cli, plamo_checkpoint, tmp_path: Path) -> None:  # noqa: ANN001
    """mlx-lm 0.32.2 scores a PLaMo 3 sequence with the "hf" window (query + W keys) but decodes with a
    RotatingKVCache(W) (the "vllm" window): `verify`'s judge (greedy judged along the target's own path, both
    conventions) finds that no convention explains both, so the export is kept and exits 1, the first divergence
    named in the greedy phase under hf while every teacher-forced position under hf agrees.  Shown to fail with the
    greedy comparison dropped from deploy/verify.py's compare_target (the export then passed under hf)."""
    out = tmp_path / "mlx"
    record = export(cli, plamo_checkpoint("tiny3"), out, expect=1)
    v = record["verification"]
    t = v["targets"][0]
    hf, vllm = t["conventions"]["window_convention=hf"], t["conventions"]["window_convention=vllm"]
    assert not v["passed"] and t["follows"] == []
    assert hf["teacher_forced"]["divergent_positions"] == 0 and hf["first_divergence"]["phase"] == "greedy"
    assert vllm["teacher_forced"]["divergent_positions"] > 0
    assert "window_decode" in [d["key"] for d in record["known_differences"]]
    assert (out / "config.json").is_file()  # the export is sound: the divergence is mlx-lm's


def test_plamo3_yarn_is_a_known_difference(cli, plamo_checkpoint, tmp_path: Path) -> None:  # noqa: ANN001
    out = tmp_path / "mlx"
    record = export(cli, plamo_checkpoint("tiny3-yarn"), out, expect=1)
    assert record["known_differences"][0]["key"] == "yarn"
    assert not record["verification"]["passed"]


def test_a_planted_bad_recipe_is_flagged(plamo_checkpoint, tmp_path: Path) -> None:  # noqa: ANN001
    """PLaMo 2's ssm_out (out_proj) at 2 bits in an 8-bit export: the measured KL says so (the
    clean 8-bit export of the same checkpoint passes)."""
    from plamo2_tools.convert.sources import open_source, source_side_files
    from plamo2_tools.export.mlx import Recipe, export_mlx, verifier

    src = plamo_checkpoint("tiny", **WIDE)
    figures = {}
    for name, overrides in (("clean", {}), ("planted", {"*.mixer.out_proj": 2})):
        recipe = Recipe(bits=8, overrides=overrides)
        source = open_source(src)
        try:
            record = export_mlx(
                source, source_side_files(source), tmp_path / name, recipe, verify=verifier(src, recipe)
            )
        finally:
            source.close()
        figures[name] = record["verification"]
    assert figures["clean"]["passed"], figures["clean"]["summary"]
    assert not figures["planted"]["passed"], figures["planted"]["summary"]
    clean, planted = (
        figures[k]["targets"][0]["conventions"]["default"]["teacher_forced"]["mean_kl"] for k in ("clean", "planted")
    )
    assert planted > 10 * clean


def test_an_export_from_shards_verifies_against_the_reference(cli, checkpoint, shards, tmp_path: Path) -> None:  # noqa: ANN001
    """Verified against --reference: every teacher-forced position agrees under hf (mlx-lm's PLaMo 3 decode
    differs, test_plamo3_scores_with_the_hf_window_and_decodes_with_the_vllm_one)."""
    out = tmp_path / "mlx"
    record = export(cli, shards("tiny3", 2, 1), out, "--reference", checkpoint("tiny3"), expect=1)
    v = record["verification"]
    assert v["reference"]["path"] == str(checkpoint("tiny3")), v["summary"]
    hf = v["targets"][0]["conventions"]["window_convention=hf"]["teacher_forced"]
    assert hf["divergent_positions"] == 0 and hf["mean_kl"] < 1e-8


def test_verify_on_the_output_gives_the_export_s_verdict(cli, plamo_checkpoint, tmp_path: Path) -> None:  # noqa: ANN001
    """`plamo2-tools verify OUT --reference SRC` on an exported directory: the same judge as the export's own
    verification (a float32 export passes, under the float32 thresholds the target declares).  Shown to fail
    before MLXTarget named its options (open_target handed it every verify option and it refused them: exit 2)
    and, for the precision, with `precision` dropped from MLXTarget.info (judged as the assumed bfloat16)."""
    src = plamo_checkpoint("tiny", **WIDE)
    out = tmp_path / "mlx"
    export(cli, src, out, "--no-verify")
    result = json.loads(cli("verify", out, "--reference", src, "--random", 2, "--max-new-tokens", 2, "--json").stdout)
    t = result["targets"][0]
    assert result["passed"] and t["kind"] == "mlx" and t["precision"] == "float32", t["failures"]
    assert t["precision_source"] == "the target (float32)"
