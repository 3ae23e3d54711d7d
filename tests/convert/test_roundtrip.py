"""merge inverts convert; convert is deterministic; shards can be resharded without the HF
checkpoint.  Pure reshard tensors must come back bit for bit; only A (= -exp(A_log)) and the
offset norms may differ, by the rounding of their transform.

These use synth's random values rather than the watermark: the norm deltas are then small next to
their offsets, so an inverse that forgot an offset could not hide inside the tolerance.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from convert_expect import LAYER_NORM_OFFSETS, load_hf, load_rank

from plamo2_tools.model.synth import preset_config
from plamo2_tools.shards.manifest import MANIFEST_NAME

OFFSETS = {**{f"{n}.weight": off for n, off in LAYER_NORM_OFFSETS.items()}, "model.norm.weight": 1.0}


def _offset_of(key: str) -> float | None:
    return next((off for suffix, off in OFFSETS.items() if key.endswith(suffix)), None)


def _assert_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype} {a.shape} != {b.dtype} {b.shape}"
    assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), f"{what}: bytes differ"


def _assert_within_transform_rounding(got: torch.Tensor, want: torch.Tensor, key: str) -> None:
    """A_log/A: log(-(-exp(x))) and -exp of that; offset norms: (x + c) - c.  Either is off by at
    most a couple of ulps of the intermediate value; forgetting c would be off by c itself."""
    assert got.dtype == want.dtype and got.shape == want.shape, key
    off = _offset_of(key)
    scale = want.float().abs() + (abs(off) if off is not None else 0.0)
    bound = 2 * torch.finfo(got.dtype).eps * scale + 1e-7  # 2 ulps of the offset value; log/exp near 0
    err = (got.float() - want.float()).abs()
    assert (err <= bound).all(), f"{key}: max error {err.max().item():.3g} beyond rounding"


@pytest.mark.parametrize(
    ("preset", "tp", "pp", "extra"),
    [
        ("tiny-gqa", 2, 2, ()),
        ("tiny-gqa", 8, 3, ()),
        ("tiny", 4, 3, ()),
        ("tiny-edge", 2, 2, ("--max-part-size", "20kB")),
    ],
)
def test_merge_round_trip(cli, checkpoint, tmp_path: Path, preset: str, tp: int, pp: int, extra: tuple) -> None:
    src = checkpoint(preset, seed=1)
    cli("convert", src, tmp_path / "shards", "--tp", tp, "--pp", pp, "--json", *extra)
    cli("merge", tmp_path / "shards", tmp_path / "merged", "--json")
    original, merged = load_hf(src), load_hf(tmp_path / "merged")
    assert sorted(merged) == sorted(original)
    for key, want in original.items():
        if key.endswith("A_log") or _offset_of(key) is not None:
            _assert_within_transform_rounding(merged[key], want, key)
        else:
            _assert_bits(merged[key], want, key)
    assert (tmp_path / "merged" / "config.json").read_bytes() == (src / "config.json").read_bytes()


def test_merge_keeps_a_cast(cli, checkpoint, tmp_path: Path) -> None:
    """--dtype bfloat16 cannot be undone: merge gives the bf16 values, A_log back in float32."""
    src = checkpoint("tiny-gqa", seed=1)
    cli("convert", src, tmp_path / "shards", "--tp", 2, "--dtype", "bfloat16", "--json")
    cli("merge", tmp_path / "shards", tmp_path / "merged", "--max-part-size", "300kB", "--json")
    assert (tmp_path / "merged" / "model.safetensors.index.json").exists()  # several parts
    original, merged = load_hf(src), load_hf(tmp_path / "merged")
    for key, want in original.items():
        if key.endswith("A_log"):
            _assert_within_transform_rounding(merged[key], want, key)
        elif _offset_of(key) is not None:
            _assert_within_transform_rounding(merged[key], want.to(torch.bfloat16), key)
        else:
            _assert_bits(merged[key], want.to(torch.bfloat16), key)


def test_two_runs_give_identical_bytes(cli, checkpoint, tmp_path: Path) -> None:
    src = checkpoint("tiny-gqa", values="watermark")
    for name in ("a", "b"):
        cli("convert", src, tmp_path / name, "--tp", 2, "--pp", 3, "--max-part-size", "100kB", "--json")
    files_a = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files_a == sorted(p.name for p in (tmp_path / "b").iterdir())
    assert len([f for f in files_a if f.endswith(".safetensors")]) > 6
    for name in files_a:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    manifest = json.loads((tmp_path / "a" / MANIFEST_NAME).read_text())
    digests = {n: f["digest"] for n, f in manifest["files"].items()}
    assert len(set(digests.values())) == len(digests)  # every rank/part really differs


@pytest.mark.parametrize(("first", "second"), [((2, 2), (4, 1)), ((4, 3), (2, 2)), ((8, 1), (1, 3))])
def test_reshard_from_shards_equals_direct(cli, checkpoint, tmp_path: Path, first, second) -> None:
    """HF -> TP a x PP b -> TP c x PP d gives what HF -> TP c x PP d gives."""
    src = checkpoint("tiny-gqa", seed=1)
    (t1, p1), (t2, p2) = first, second
    cli("convert", src, tmp_path / "first", "--tp", t1, "--pp", p1, "--json")
    cli("convert", tmp_path / "first", tmp_path / "resharded", "--tp", t2, "--pp", p2, "--json")
    cli("convert", src, tmp_path / "direct", "--tp", t2, "--pp", p2, "--json")
    for rank in range(t2 * p2):
        got, want = load_rank(tmp_path / "resharded", rank), load_rank(tmp_path / "direct", rank)
        assert sorted(got) == sorted(want)
        for key in want:
            if key.endswith("mixer.A") or _offset_of(key) is not None:
                _assert_within_transform_rounding(got[key], want[key], f"rank {rank} {key}")
            else:
                _assert_bits(got[key], want[key], f"rank {rank} {key}")
    manifest = json.loads((tmp_path / "resharded" / MANIFEST_NAME).read_text())
    assert manifest["source"]["kind"] == "shards"
    cli("check", tmp_path / "resharded", "--json")


def test_merge_refuses_bad_targets(cli, checkpoint, tmp_path: Path) -> None:
    src = checkpoint("tiny", values="watermark")
    r = cli("merge", src, tmp_path / "merged", expect=2)  # an HF checkpoint is not a shard directory
    assert "plamo2_shards.json" in r.stderr
    cli("convert", src, tmp_path / "shards", "--json")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")
    r = cli("merge", tmp_path / "shards", tmp_path / "busy", expect=2)
    assert "--force" in r.stderr and (tmp_path / "busy" / "keep.txt").exists()
    cli("merge", tmp_path / "shards", tmp_path / "busy", "--force", "--json")
    assert (tmp_path / "busy" / "keep.txt").read_text() == "mine"  # --force writes beside the user's files
    r = cli("merge", tmp_path / "shards", tmp_path / "shards" / "inside", expect=2)
    assert "inside the source" in r.stderr
    assert preset_config("tiny").vocab_size == load_hf(tmp_path / "busy")["model.embed_tokens.weight"].shape[0]


def test_small_chunks_in_merge_and_reshard(cli, checkpoint, tmp_path: Path, monkeypatch) -> None:
    """The chunked paths of merge and of reading shards as a source (rows that start mid-piece)."""
    from plamo2_tools.convert import merge, writer

    src = checkpoint("tiny-gqa", seed=1)
    cli("convert", src, tmp_path / "shards", "--tp", 4, "--pp", 2, "--json")
    cli("convert", src, tmp_path / "direct", "--tp", 2, "--pp", 3, "--json")
    monkeypatch.setattr(writer, "CHUNK_BYTES", 5 * 96 * 4)
    monkeypatch.setattr(merge, "CHUNK_BYTES", 5 * 96 * 4)
    cli("merge", tmp_path / "shards", tmp_path / "merged", "--json")
    cli("convert", tmp_path / "shards", tmp_path / "resharded", "--tp", 2, "--pp", 3, "--json")
    for key, want in load_hf(src).items():
        got = load_hf(tmp_path / "merged")[key]
        if key.endswith("A_log") or _offset_of(key) is not None:
            _assert_within_transform_rounding(got, want, key)
        else:
            _assert_bits(got, want, key)
    for rank in range(6):
        got, want = load_rank(tmp_path / "resharded", rank), load_rank(tmp_path / "direct", rank)
        for key in want:
            if key.endswith("mixer.A") or _offset_of(key) is not None:
                _assert_within_transform_rounding(got[key], want[key], key)
            else:
                _assert_bits(got[key], want[key], key)
