"""An untied lm_head comes with HF's rows rounded up to 16 (PLaMo's remote code) or with exactly
vocab_size rows (other exports): both are accepted and convert to the same shards; merge gives
back the shape it was given."""

from __future__ import annotations

import shutil
from pathlib import Path

import safetensors.torch
import torch
from convert_expect import load_hf, load_rank

from plamo2_tools.convert.engine import convert
from plamo2_tools.convert.merge import merge
from plamo2_tools.model.checkpoint import HFCheckpoint
from plamo2_tools.model.plamo2.reference import reference_logits
from plamo2_tools.model.synth import preset_config


def _with_v_rows(src: Path, dst: Path) -> None:
    """A copy of `src` whose lm_head keeps exactly vocab_size rows."""
    shutil.copytree(src, dst)
    tensors = load_hf(dst)
    V = preset_config("tiny-gqa").vocab_size
    assert tensors["lm_head.weight"].shape[0] > V  # 515 rounded up to 528: the test can tell them apart
    tensors["lm_head.weight"] = tensors["lm_head.weight"][:V].clone()
    (dst / "model.safetensors").unlink()
    safetensors.torch.save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})


def test_lm_head_with_vocab_size_rows_converts_the_same(checkpoint, tmp_path: Path) -> None:
    rounded = checkpoint("tiny-gqa", seed=1)
    exact = tmp_path / "exact"
    _with_v_rows(rounded, exact)
    convert(rounded, tmp_path / "a", tp=2, pp=2)
    convert(exact, tmp_path / "b", tp=2, pp=2)
    for rank in range(4):
        a, b = load_rank(tmp_path / "a", rank), load_rank(tmp_path / "b", rank)
        assert sorted(a) == sorted(b)
        assert all(torch.equal(a[k], b[k]) for k in a), f"rank {rank}"
    with HFCheckpoint(rounded) as r, HFCheckpoint(exact) as e:
        tokens = [[5, 300, 514, 7, 0]]
        assert torch.equal(reference_logits(r, tokens)[0], reference_logits(e, tokens)[0])
    merge(tmp_path / "b", tmp_path / "merged")
    assert load_hf(tmp_path / "merged")["lm_head.weight"].shape[0] == preset_config("tiny-gqa").vocab_size


def test_lm_head_with_other_row_counts_is_refused(checkpoint, tmp_path: Path, cli) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(checkpoint("tiny-gqa", seed=1), bad)
    tensors = load_hf(bad)
    tensors["lm_head.weight"] = tensors["lm_head.weight"][:-20].clone()
    safetensors.torch.save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    result = cli("convert", bad, tmp_path / "out", expect=2)
    assert "wrong shape for lm_head.weight" in result.stderr
