"""The converter's own machinery, checked on its output: output split into parts (--max-part-size),
sources in several files, tensors copied and computed in small windows and chunks, every way of
copying verbatim bytes (and the fallbacks when the kernel refuses one), and a failing job stopping
the whole run cleanly.  What the output must hold comes from convert_expect (the spec table)."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
from convert_expect import (
    Watermark,
    assert_same_tensors,
    expected_rank,
    load_hf,
    load_rank,
    rank_files,
    stage_ranges,
    vllm_pp_counts,
)

from plamo2_tools.model.synth import preset_config
from plamo2_tools.shards.manifest import MANIFEST_NAME


def _same_files(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.glob("model-rank-*"))
    assert names and names == sorted(p.name for p in b.glob("model-rank-*"))
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


# ---- how the output is split: parts, and sources in several files -----------------------------------
def test_max_part_size_splits_ranks_into_parts(shards, checkpoint) -> None:
    limit = 40_000
    out = shards("tiny-gqa", 2, 1, "--max-part-size", str(limit), values="watermark")
    cfg = preset_config("tiny-gqa")
    hf = load_hf(checkpoint("tiny-gqa", values="watermark"))
    stages = stage_ranges([cfg.num_hidden_layers])
    for rank in range(2):
        files = rank_files(out, rank)
        assert len(files) > 3
        keys_per_part = []
        for f in files:
            with open(f, "rb") as fh:
                header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
            meta = header.pop("__metadata__")
            assert meta["tp_rank"] == str(rank) and meta["format"] == "pt"
            payload = sum(e["data_offsets"][1] - e["data_offsets"][0] for e in header.values())
            assert payload <= limit or len(header) == 1, f"{f.name}: {payload} bytes in {len(header)} tensors"
            keys_per_part.append(sorted(header))
        # greedy in sorted key order: every part's keys come after the previous part's
        flat = [k for keys in keys_per_part for k in keys]
        assert flat == sorted(flat)
        assert_same_tensors(load_rank(out, rank), expected_rank(hf, cfg, 2, stages, rank), f"rank {rank}")
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["mapping"]["ranks"][0]["files"] == [f.name for f in rank_files(out, 0)]


def test_source_split_over_several_files(cli, checkpoint, tmp_path: Path) -> None:
    """An HF checkpoint in 4 files with model.safetensors.index.json gives the same shards."""
    single, split = checkpoint("tiny-gqa", values="watermark"), checkpoint("tiny-gqa", files=4, values="watermark")
    assert (split / "model.safetensors.index.json").exists()
    cli("convert", single, tmp_path / "a", "--tp", 4, "--pp", 2, "--json")
    cli("convert", split, tmp_path / "b", "--tp", 4, "--pp", 2, "--json")
    for rank in range(8):
        name = f"model-rank-{rank}-part-0.safetensors"
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert not (tmp_path / "b" / "model.safetensors.index.json").exists()  # the HF index is not copied
    manifest = json.loads((tmp_path / "b" / MANIFEST_NAME).read_text())
    assert len(manifest["source"]["files"]) == 4


# ---- tensors written in small windows and chunks ----------------------------------------------------
CHUNKED = [("tiny-gqa", 4, 2), ("tiny-gqa", 8, 1), ("tiny", 2, 3), ("tiny-edge", 2, 1)]


@pytest.mark.parametrize(("preset", "tp", "pp"), CHUNKED)
def test_many_small_chunks(
    cli, checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, preset: str, tp: int, pp: int
) -> None:
    """Real tensors are copied in 8 MiB windows (computed ones read in 8 MiB row chunks); the tiny
    ones fit in one.  Windows and chunks of 2688 bytes (7 rows of D=96 floats, 4 rows of F=160,
    672 elements of a vector) cut through heads, gate/up halves, vocab shards, padding and mmap
    pages at odd places."""
    from plamo2_tools.convert import writer

    monkeypatch.setattr(writer, "CHUNK_BYTES", 7 * 96 * 4)
    monkeypatch.setattr(writer, "WINDOW", 7 * 96 * 4)
    out = tmp_path / "out"
    cli("convert", checkpoint(preset, values="watermark"), out, "--tp", tp, "--pp", pp, "--json")
    cfg = preset_config(preset)
    hf = load_hf(checkpoint(preset, values="watermark"))
    stages = stage_ranges(vllm_pp_counts(cfg.num_hidden_layers, pp))
    for rank in range(tp * pp):
        want = expected_rank(hf, cfg, tp, stages, rank)
        assert_same_tensors(load_rank(out, rank), want, f"{preset} tp={tp} pp={pp} rank {rank}", Watermark(cfg).decode)
    cli("check", out, "--json")  # digests and padding of a chunk-by-chunk written file
    cli("check", out, "--source", checkpoint(preset, values="watermark"), "--json")  # and every byte


# ---- how bytes are copied -----------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["copy_file_range", "sendfile", "user"])
def test_every_copy_path_writes_the_same_bytes(cli, checkpoint, tmp_path: Path, mode: str) -> None:
    """Kernel-side and user-space copies, each forced, give byte-identical files and manifests
    (the JSON says the forced path really carried the verbatim bytes)."""
    src = checkpoint("tiny-gqa", values="watermark")
    cli("convert", src, tmp_path / "auto", "--tp", 2, "--pp", 2, "--json")
    r = json.loads(cli("convert", src, tmp_path / mode, "--tp", 2, "--pp", 2, "--copy", mode, "--json").stdout)
    used = {k for k in ("copy_file_range", "sendfile", "user") if r["copy"]["bytes"][k]}
    assert used == {mode}
    _same_files(tmp_path / "auto", tmp_path / mode)
    cli("check", tmp_path / mode, "--source", src, "--json")
    a, b = (json.loads((tmp_path / d / MANIFEST_NAME).read_text()) for d in ("auto", mode))
    assert (a["files"], a["tensors"]) == (b["files"], b["tensors"])


def test_refused_kernel_copies_fall_back(cli, checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """copy_file_range refused (EXDEV: source and output on different filesystems) -> sendfile;
    sendfile refused too -> user space; a forced path that is refused stops with one line."""
    src = checkpoint("tiny-gqa", values="watermark")
    cli("convert", src, tmp_path / "reference", "--tp", 2, "--json")

    def refuse(*args: object) -> int:
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))

    monkeypatch.setattr(os, "copy_file_range", refuse)
    r = json.loads(cli("convert", src, tmp_path / "sendfile", "--tp", 2, "--json").stdout)
    assert r["copy"]["bytes"]["copy_file_range"] == 0 and r["copy"]["bytes"]["sendfile"] > 0
    monkeypatch.setattr(os, "sendfile", refuse)
    r = json.loads(cli("convert", src, tmp_path / "user", "--tp", 2, "--json").stdout)
    assert r["copy"]["bytes"]["sendfile"] == 0 and r["copy"]["bytes"]["user"] > 0
    for d in ("sendfile", "user"):
        _same_files(tmp_path / "reference", tmp_path / d)
    r = cli("convert", src, tmp_path / "forced", "--tp", 2, "--copy", "copy_file_range", expect=3)
    assert "--copy copy_file_range is refused here" in r.stderr
    assert not (tmp_path / "forced" / MANIFEST_NAME).exists()


def test_a_failing_job_stops_the_run_cleanly(
    cli, medium_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk fills up under one job while others run: one error line (exit 3), every job stopped
    before the unfinished files are removed, no manifest; the finished files resume."""
    real, calls = os.copy_file_range, [0]

    def fill_up(*args: int) -> int:
        calls[0] += 1
        if calls[0] == 40:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(*args)

    monkeypatch.setattr(os, "copy_file_range", fill_up)
    out = tmp_path / "out"
    split = ("--tp", 2, "--pp", 2, "--max-part-size", "1MB")
    r = cli("convert", medium_checkpoint, out, *split, "--workers", 8, expect=3)
    assert "no space left on device" in r.stderr
    assert not (out / MANIFEST_NAME).exists() and not list(out.glob("*.partial"))
    monkeypatch.setattr(os, "copy_file_range", real)
    assert json.loads(cli("convert", medium_checkpoint, out, *split, "--json").stdout)["status"] == "resumed"
    cli("check", out, "--json")
