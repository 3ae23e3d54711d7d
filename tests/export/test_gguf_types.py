"""Storage types of `export gguf` without llama.cpp: --recipe, --tensor-type rules (first match wins,
only on the tensors that take the file's type), llama.cpp's F16 fallback, and the bytes of each type
checked against an independent formulation (q8_0 / q4_0 dequantized by the `gguf` package must be
within half a step of the source; f16 / bf16 are the source rounded by numpy / by bit arithmetic here).

Seen failing: with the rules applied before llama.cpp's F32 rule (ssm_dt_norm stored Q8_0), with the
last matching rule winning (ssm_out as Q8_0), with the value transforms skipped (post_ffw_norm is
source + 1/5**1.5 only with them).
"""

from __future__ import annotations

import numpy as np
from llama_cpp_env import gguf_fields, gguf_tensors
from safetensors import safe_open

from plamo2_tools.export.gguf import export_gguf


def test_the_plamo2_recipe_keeps_ssm_out_in_f16(checkpoint, tmp_path) -> None:
    out = tmp_path / "m.gguf"
    result = export_gguf(checkpoint("tiny"), out, "q4_0", recipe="ssm-out-f16", verify=False)
    tensors = gguf_tensors(out)
    assert {t for n, (t, _, _) in tensors.items() if "ssm_out" in n} == {"F16"}
    assert {t for n, (t, _, _) in tensors.items() if n.endswith(("ssm_in.weight", "ffn_up.weight"))} == {"Q4_0"}
    assert tensors["blk.0.ssm_dt_norm"][0] == "F32" and tensors["blk.0.ssm_conv1d.weight"][0] == "F32"
    assert gguf_fields(out)["general.file_type"][1] == 2  # MOSTLY_Q4_0, the file's type
    assert result.overrides == ["ssm_out=f16"]


def test_rules_first_match_wins_and_fallback_is_noted(checkpoint, tmp_path) -> None:
    out = tmp_path / "m.gguf"
    result = export_gguf(
        checkpoint("tiny-edge"), out, "q8_0", ["ssm_out=f16", "ssm_=q8_0", "ffn_up=bf16"], verify=False
    )
    tensors = gguf_tensors(out)
    assert tensors["blk.0.ssm_out.weight"][0] == "F16"
    assert tensors["blk.0.ssm_in.weight"][0] == "F16"  # hidden 48: rows do not split into 32-blocks
    assert tensors["blk.0.ffn_up.weight"][0] == "BF16"
    # "ssm_" matches these too, but norms and the convolution stay F32 (llama.cpp's rule comes first)
    assert tensors["blk.0.ssm_dt_norm"][0] == "F32" and tensors["blk.0.ssm_conv1d.weight"][0] == "F32"
    assert any("ssm_in.weight" in n and "F16" in n for n in result.notes)


def test_quantized_bytes_decode_to_the_transformed_source(checkpoint, tmp_path) -> None:
    import gguf

    src = checkpoint("tiny3")
    with safe_open(str(src / "model.safetensors"), framework="numpy") as f:
        up = f.get_tensor("model.layers.layers.1.mlp.gate_up_proj.weight")
        post = f.get_tensor("model.layers.layers.1.post_mlp_norm.weight")
    # the block's step d = max|x| / 127 (q8_0) or / 8 (q4_0), stored as f16; worst error: half a step
    # plus the f16 rounding of d times the largest code (q8_0), a whole step at q4_0's clipped end (+7)
    for kind, qtype, step, bound in (
        ("q8_0", gguf.GGMLQuantizationType.Q8_0, 127, 0.6),
        ("q4_0", gguf.GGMLQuantizationType.Q4_0, 8, 1.1),
    ):
        out = tmp_path / f"{kind}.gguf"
        export_gguf(src, out, kind, verify=False)
        t = gguf_tensors(out)
        got = gguf.quants.dequantize(
            np.frombuffer(t["blk.1.ffn_up.weight"][2], np.uint8).reshape(up.shape[0], -1), qtype
        )
        scale = np.abs(up.reshape(-1, 32)).max(axis=1, keepdims=True) / step
        assert np.all(np.abs(got.reshape(-1, 32) - up.reshape(-1, 32)) <= scale * bound + 1e-7)
        norm = np.frombuffer(t["blk.1.post_ffw_norm"][2], np.float32)
        np.testing.assert_array_equal(norm, post + np.float32(1 / 5**1.5))
    f16 = tmp_path / "f16.gguf"
    export_gguf(src, f16, "f16", verify=False)
    np.testing.assert_array_equal(
        np.frombuffer(gguf_tensors(f16)["blk.1.ffn_up.weight"][2], np.float16), up.astype(np.float16).ravel()
    )
