"""`check --source`: the end-to-end oracle of convert (issue 24).

`check` alone trusts the writer's own digests; `check --source` re-derives every tensor of every
rank from the HF checkpoint through the safetensors library, so a writer that copies the wrong
bytes fails here.  The copy paths are run with windows far smaller than the tensors and with
kernel copies that return short counts (the kernel may do that at any time), so that every
window after the first and every resumed copy is compared with the source.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from plamo2_tools.convert import writer
from plamo2_tools.shards.source_check import check_against_source

# Presets of both families x layouts that exercise row-parallel gathers (tp > 1), pipeline stages,
# casts (computed tensors) and multi-part directories.
LAYOUTS = [
    ("tiny", 1, 1, "auto", ()),
    ("tiny-gqa", 2, 2, "auto", ("--max-part-size", "30000")),
    ("tiny-edge", 2, 1, "float32", ()),
    ("tiny-2.1", 2, 3, "auto", ()),
    ("tiny3", 2, 2, "auto", ("--max-part-size", "30000")),
    ("tiny3-mqa", 4, 1, "bfloat16", ()),
]


@pytest.mark.parametrize(("preset", "tp", "pp", "dtype", "options"), LAYOUTS)
def test_converted_shards_match_their_source(cli, shards, checkpoint, preset, tp, pp, dtype, options) -> None:
    out = shards(preset, tp, pp, *options, dtype=dtype)
    report = json.loads(cli("check", out, "--source", checkpoint(preset), "--json").stdout)
    assert report["ok"] and report["kind"] == "plamo2-check-source"
    expected = sum(len(r) for r in json.loads((out / "plamo2_shards.json").read_text())["tensors"].values())
    assert report["tensors_compared"] == expected
    if "--max-part-size" in options:
        assert len(list(out.glob("model-rank-1-part-*.safetensors"))) > 1


def test_shards_of_another_checkpoint_are_named_at_the_first_difference(cli, shards, checkpoint) -> None:
    """Shards of seed 1 are a self-consistent directory (`check` passes) but not seed 0's: the
    source check names the first differing tensor and its rank, exit 1."""
    out = shards("tiny-gqa", 2, 1, seed=1)
    cli("check", out, "--json")
    r = cli("check", out, "--source", checkpoint("tiny-gqa", seed=0), "--json", expect=1)
    report = json.loads(r.stdout)
    assert not report["ok"] and report["first_problem"].startswith("rank 0: ")
    assert "differs from the source at element" in report["first_problem"]
    assert any(p.startswith("rank 1: ") for p in report["problems"])
    line = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(line) == 1 and "first: rank 0:" in line[0]


def test_one_damaged_tensor_on_a_late_rank_and_part(cli, shards, checkpoint, private_copy) -> None:
    """A byte flipped in the last part of the last rank, with the manifest's digests left alone:
    found, and named by rank and key (the human output too)."""
    out = private_copy(shards("tiny3", 2, 2, "--max-part-size", "30000"))
    last = sorted(out.glob("model-rank-3-part-*.safetensors"), key=lambda p: int(p.stem.rsplit("-", 1)[1]))[-1]
    data = bytearray(last.read_bytes())
    data[-3] ^= 0x40
    last.write_bytes(bytes(data))
    r = cli("check", out, "--source", checkpoint("tiny3"), expect=1)
    assert "rank 3:" in r.stdout and last.name in r.stdout


# ---- every copy path, many windows, short kernel copies ------------------------------------------------
def _capped_copy_file_range(cap: int) -> Callable[..., int]:
    real = os.copy_file_range

    def short(src: int, dst: int, count: int, offset_src: int | None = None, offset_dst: int | None = None) -> int:
        return real(src, dst, min(count, cap), offset_src, offset_dst)

    return short


def _capped_sendfile(cap: int) -> Callable[..., int]:
    real = os.sendfile

    def short(out_fd: int, in_fd: int, offset: int | None, count: int) -> int:
        return real(out_fd, in_fd, offset, min(count, cap))

    return short


@pytest.mark.parametrize("mode", ["copy_file_range", "sendfile", "user"])
@pytest.mark.parametrize(("preset", "tp", "pp"), [("tiny-gqa", 2, 2), ("tiny3", 2, 1)])
def test_every_copy_path_in_many_windows_and_short_copies(
    cli, checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode, preset, tp, pp
) -> None:
    """Windows of 3000 bytes (not a multiple of a row, a page or an element pair) and kernel copies
    of at most 1000 bytes: the forced path carries the verbatim bytes, and every tensor equals the
    one re-derived from the source."""
    monkeypatch.setattr(writer, "WINDOW", 3000)
    monkeypatch.setattr(writer, "CHUNK_BYTES", 3000)
    monkeypatch.setattr(os, "copy_file_range", _capped_copy_file_range(1000))
    monkeypatch.setattr(os, "sendfile", _capped_sendfile(1000))
    src, out = checkpoint(preset, values="watermark"), tmp_path / "out"
    r = json.loads(cli("convert", src, out, "--tp", tp, "--pp", pp, "--copy", mode, "--json").stdout)
    assert {k for k in ("copy_file_range", "sendfile", "user") if r["copy"]["bytes"][k]} == {mode}
    cli("check", out, "--json")
    cli("check", out, "--source", src, "--json")


def test_casts_and_gathers_in_many_chunks(cli, checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Computed tensors (a float32 -> bfloat16 cast of everything) read in chunks of a few rows, and
    row-parallel gathers a few rows at a time."""
    monkeypatch.setattr(writer, "WINDOW", 3000)
    monkeypatch.setattr(writer, "CHUNK_BYTES", 3000)
    src, out = checkpoint("tiny-gqa", values="watermark"), tmp_path / "out"
    r = json.loads(cli("convert", src, out, "--tp", 4, "--dtype", "bfloat16", "--json").stdout)
    assert r["copy"]["bytes"]["compute"] > 0
    cli("check", out, "--source", src, "--json")
    out2 = tmp_path / "gather"
    r = json.loads(cli("convert", src, out2, "--tp", 4, "--json").stdout)
    assert r["copy"]["bytes"]["gather"] > 0
    cli("check", out2, "--source", src, "--json")


def test_a_source_that_is_not_a_checkpoint_is_refused(cli, shards, tmp_path: Path, one_line_error) -> None:
    r = cli("check", shards("tiny", 1, 1), "--source", tmp_path, expect=2)
    assert "not an HF checkpoint" in one_line_error(r, 2)


def test_another_models_checkpoint_is_named_not_cut(cli, shards, checkpoint) -> None:
    """The source of another preset: its config and its tensors' shapes are named, nothing is sliced."""
    r = cli("check", shards("tiny", 1, 1), "--source", checkpoint("tiny-gqa"), "--json", expect=1)
    report = json.loads(r.stdout)
    assert report["tensors_compared"] == 0
    assert "config.json is not the config" in report["problems"][0]
    assert any("the shards were cut from" in p or "is not in the checkpoint" in p for p in report["problems"])


def _nudge(path: Path, key: str, element: int = 0) -> None:
    """Add one unit in the last place to one float32 element of a tensor, in place."""
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    entry = json.loads(raw[8 : 8 + n])[key]
    assert entry["dtype"] == "F32"
    at = 8 + n + entry["data_offsets"][0] + 4 * element
    raw[at : at + 4] = (int.from_bytes(raw[at : at + 4], "little") + 1).to_bytes(4, "little")
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(("key", "allowed"), [("model.layers.layers.0.mixer.A", 1), ("model.norm.weight", 0)])
def test_one_ulp_is_allowed_only_where_exp_made_the_value(
    shards, checkpoint, private_copy, key: str, allowed: int
) -> None:
    """exp is not correctly rounded anywhere (torch, numpy and libm differ by one ulp), so A =
    -exp(A_log) is compared within one ulp; any other tensor one ulp off is a difference."""
    out = private_copy(shards("tiny", 1, 1))
    f = out / "model-rank-0-part-0.safetensors"
    for _ in range(allowed):
        _nudge(f, key)
        assert check_against_source(out, checkpoint("tiny")).ok  # (the digests would differ: not asked here)
    _nudge(f, key)  # one more than allowed
    report = check_against_source(out, checkpoint("tiny"))
    assert len(report.problems) == 1 and key in report.problems[0]
