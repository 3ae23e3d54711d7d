"""Bad input through the real CLI: one clear `error:` line, exit 2 (user) or 3 (environment), and
never a manifest in OUT (its presence would claim a complete conversion)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import safetensors.torch
from convert_expect import flip_byte, load_hf

from plamo2_tools.shards.manifest import MANIFEST_NAME


def _fails(cli, *args, code: int, says: str) -> str:
    r = cli("convert", *args, expect=code)
    # stderr may also hold the progress bar; the error itself is exactly one line, the last one.
    lines = r.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], r.stderr
    assert says in errors[0], errors[0]
    return errors[0]


def _no_manifest(out: Path) -> None:
    assert not (out / MANIFEST_NAME).exists()
    if out.exists():
        assert not list(out.glob("*.partial")), "unfinished files must be removed on an error"


def _rewrite_header(path: Path, edit: Callable[[dict], None]) -> None:
    """Edit a safetensors header in place, keeping its length (padded with spaces)."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    edit(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    path.write_bytes(data[:8] + text + b" " * (n - len(text)) + data[8 + n :])


def _resave(src: Path, dst: Path, edit: Callable[[dict], None]) -> Path:
    """dst: src's config and tensors after `edit(tensors)` (re-saved with the safetensors library)."""
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = load_hf(src)
    edit(tensors)
    safetensors.torch.save_file(tensors, str(dst / "model.safetensors"), {"format": "pt"})
    return dst


def test_truncated_file(cli, checkpoint, private_copy, tmp_path: Path) -> None:
    src = private_copy(checkpoint("tiny", values="watermark"))
    with open(src / "model.safetensors", "r+b") as f:
        f.truncate((src / "model.safetensors").stat().st_size - 100)
    _fails(cli, src, tmp_path / "out", code=2, says="truncated")
    _no_manifest(tmp_path / "out")


def test_file_shorter_than_its_header(cli, checkpoint, private_copy, tmp_path: Path) -> None:
    src = private_copy(checkpoint("tiny", values="watermark"))
    with open(src / "model.safetensors", "r+b") as f:
        f.truncate(1000)
    _fails(cli, src, tmp_path / "out", code=2, says="truncated")
    _no_manifest(tmp_path / "out")


def test_header_not_json(cli, checkpoint, private_copy, tmp_path: Path) -> None:
    src = private_copy(checkpoint("tiny", values="watermark"))
    data = bytearray((src / "model.safetensors").read_bytes())
    data[20] = ord("}")  # somewhere inside the JSON text
    (src / "model.safetensors").write_bytes(bytes(data))
    _fails(cli, src, tmp_path / "out", code=2, says="corrupt header")
    _no_manifest(tmp_path / "out")


def test_header_length_absurd(cli, checkpoint, private_copy, tmp_path: Path) -> None:
    src = private_copy(checkpoint("tiny", values="watermark"))
    data = bytearray((src / "model.safetensors").read_bytes())
    data[:8] = struct.pack("<Q", 2**40)
    (src / "model.safetensors").write_bytes(bytes(data))
    _fails(cli, src, tmp_path / "out", code=2, says="corrupt header")


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (lambda h: h["model.norm.weight"].update(data_offsets=[0, 8]), "do not match"),  # wrong length
        # one tensor moved 4 bytes on, length kept: a hole before it and an overlap after it
        (
            lambda h: h["model.norm.weight"].update(
                data_offsets=[
                    h["model.norm.weight"]["data_offsets"][0] + 4,
                    h["model.norm.weight"]["data_offsets"][1] + 4,
                ]
            ),
            "hole or overlap",
        ),
    ],
    ids=["length", "overlap"],
)
def test_header_bad_offsets(cli, checkpoint, private_copy, tmp_path: Path, edit, says: str) -> None:
    src = private_copy(checkpoint("tiny", values="watermark"))
    _rewrite_header(src / "model.safetensors", edit)
    _fails(cli, src, tmp_path / "out", code=2, says=says)
    _no_manifest(tmp_path / "out")


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (
            lambda t: t.pop("model.layers.layers.1.mixer.k_weight"),
            "missing tensor model.layers.layers.1.mixer.k_weight",
        ),
        (
            lambda t: t.update({"model.layers.layers.1.mixer.rotary_emb.inv_freq": t["model.norm.weight"][:8].clone()}),
            "unexpected tensor model.layers.layers.1.mixer.rotary_emb.inv_freq",
        ),
        (
            lambda t: t.update({"model.layers.layers.0.mixer.D": t["model.layers.layers.0.mixer.D"][:-1].clone()}),
            "wrong shape for model.layers.layers.0.mixer.D: [7], expected [8]",
        ),
    ],
    ids=["missing", "unexpected", "shape"],
)
def test_wrong_tensors(cli, checkpoint, tmp_path: Path, edit, says: str) -> None:
    src = _resave(checkpoint("tiny", values="watermark"), tmp_path / "src", edit)
    _fails(cli, src, tmp_path / "out", code=2, says=says)
    _no_manifest(tmp_path / "out")


def test_many_wrong_tensors_still_one_line(cli, checkpoint, tmp_path: Path) -> None:
    src = _resave(
        checkpoint("tiny", values="watermark"),
        tmp_path / "src",
        lambda t: [t.pop(k) for k in list(t) if ".layers.0." in k],
    )
    line = _fails(cli, src, tmp_path / "out", code=2, says="(17 problem(s))")
    assert line.count("missing tensor model.layers.layers.0.") == 17  # every one named, still one line


@pytest.mark.parametrize(
    ("preset", "args", "says"),
    [
        ("tiny-gqa", ("--tp", "3"), "tp=3 does not divide 8 attention heads"),
        ("tiny-gqa", ("--tp", "16"), "tp=16 does not divide 8 attention heads"),
        ("tiny", ("--tp", "8"), "tp=8 does not divide 4 attention heads"),
        ("tiny-gqa", ("--tp", "0"), "tp=0 must be >= 1"),
        ("tiny", ("--pp", "5"), "pp=5 is more stages than the 4 layers"),
        ("tiny-edge", ("--pp", "3"), "pp=3 is more stages than the 2 layers"),
        ("tiny-gqa", ("--pp", "3", "--pp-layers", "2,2,2"), "must be >= 1 each and sum to 5 layers"),
        ("tiny-gqa", ("--pp", "2", "--pp-layers", "5"), "--pp-layers has 1 entries but pp=2"),
        ("tiny", ("--dtype", "int8"), "unknown --dtype 'int8'"),
        ("tiny", ("--max-part-size", "lots"), "cannot read size 'lots'"),
    ],
)
def test_impossible_split_or_option(cli, checkpoint, tmp_path: Path, preset: str, args: tuple, says: str) -> None:
    _fails(cli, checkpoint(preset, values="watermark"), tmp_path / "out", *args, code=2, says=says)
    assert not (tmp_path / "out").exists()  # refused before touching OUT


def test_output_is_or_is_inside_the_source(cli, checkpoint, private_copy) -> None:
    src = private_copy(checkpoint("tiny", values="watermark"))
    _fails(cli, src, src, code=2, says="is the source directory")
    _fails(cli, src, src / "shards", code=2, says="is inside the source directory")
    assert not (src / "shards").exists() and not (src / MANIFEST_NAME).exists()


def test_output_exists_without_force(cli, checkpoint, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("someone else's")
    _fails(cli, checkpoint("tiny", values="watermark"), out, code=2, says="use --force")
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    cli("convert", checkpoint("tiny", values="watermark"), out, "--json", "--force")
    assert (out / MANIFEST_NAME).exists()


def test_different_completed_conversion_needs_force(cli, checkpoint, tmp_path: Path) -> None:
    src, out = checkpoint("tiny", values="watermark"), tmp_path / "out"
    cli("convert", src, out, "--tp", 2, "--pp", 2, "--json")
    before = (out / MANIFEST_NAME).read_bytes()
    assert json.loads(cli("convert", src, out, "--tp", 2, "--pp", 2, "--json").stdout)["status"] == "up-to-date"
    _fails(cli, src, out, "--tp", 4, code=2, says="holds a different completed conversion; use --force")
    assert (out / MANIFEST_NAME).read_bytes() == before  # untouched
    cli("convert", src, out, "--tp", 4, "--json", "--force")
    assert json.loads((out / MANIFEST_NAME).read_text())["mapping"]["tp_size"] == 4
    assert sorted(p.name for p in out.glob("model-rank-*")) == [f"model-rank-{r}-part-0.safetensors" for r in range(4)]
    cli("check", out, "--json")


def test_not_enough_disk(cli, checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src, real = checkpoint("tiny", values="watermark"), shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    _fails(cli, src, tmp_path / "out", code=3, says="not enough disk space")
    _no_manifest(tmp_path / "out")
    assert not list((tmp_path / "out").glob("model-rank-*"))


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_enospc_while_sizing_the_file(cli, checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = checkpoint("tiny", values="watermark")
    monkeypatch.setattr(os, "ftruncate", _enospc)
    _fails(cli, src, tmp_path / "out", code=3, says="no space left on device")
    _no_manifest(tmp_path / "out")


def test_enospc_while_writing(cli, checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk fills up half way (the free-space check passed, then something else took it)."""
    src, real, calls = checkpoint("tiny-gqa", values="watermark"), os.pwrite, [0]

    def pwrite(fd: int, data, offset: int) -> int:
        calls[0] += 1
        if calls[0] > 40:
            _enospc()
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    out = tmp_path / "out"
    _fails(cli, src, out, "--tp", 2, "--pp", 2, code=3, says="no space left on device")
    _no_manifest(out)
    monkeypatch.setattr(os, "pwrite", real)  # space again: the rerun completes
    cli("convert", src, out, "--tp", 2, "--pp", 2, "--json")
    cli("check", out, "--json")


def test_not_a_checkpoint(cli, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    _fails(cli, tmp_path / "empty", tmp_path / "out", code=2, says="config.json")
    _fails(cli, tmp_path / "nowhere", tmp_path / "out", code=2, says="not a directory")


def test_output_is_a_file(cli, checkpoint, tmp_path: Path) -> None:
    src = checkpoint("tiny", values="watermark")
    (tmp_path / "afile").write_text("not a directory")
    _fails(cli, src, tmp_path / "afile", code=2, says="exists and is not a directory")
    _fails(cli, src, tmp_path / "afile" / "out", code=2, says="exists and is not a directory")
    assert (tmp_path / "afile").read_text() == "not a directory"
    cli("convert", src, tmp_path / "shards", "--json")
    r = cli("merge", tmp_path / "shards", tmp_path / "afile", expect=2)
    assert r.stderr.strip().splitlines()[-1].endswith("exists and is not a directory")


def test_output_directory_cannot_be_created(cli, checkpoint, tmp_path: Path, monkeypatch) -> None:
    """Permissions or a read-only mount (root passes permission checks, so simulated)."""
    src = checkpoint("tiny", values="watermark")

    def refuse(self, *args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(Path, "mkdir", refuse)
    _fails(cli, src, tmp_path / "out", code=3, says="cannot create the output directory")


def test_damaged_shards_are_not_resharded_or_merged(cli, checkpoint, tmp_path: Path) -> None:
    """Reading shards back checks headers only; the manifest's digests must catch the rest, or the
    damage would come out under a fresh manifest that `check` then passes."""
    shards = tmp_path / "shards"
    cli("convert", checkpoint("tiny-gqa", values="watermark"), shards, "--tp", 2, "--json")
    flip_byte(shards / "model-rank-1-part-0.safetensors", -100)
    says = "model-rank-1-part-0.safetensors: xxh3-128 digest differs from the manifest"
    _fails(cli, shards, tmp_path / "resharded", "--tp", 4, code=2, says=says)
    assert not (tmp_path / "resharded").exists()
    r = cli("merge", shards, tmp_path / "merged", expect=2)
    assert "digest differs from the manifest" in r.stderr and not (tmp_path / "merged").exists()


def test_damaged_hf_cache_blob_is_refused(cli, checkpoint, tmp_path: Path) -> None:
    """In an HF cache the weights are links to blobs named by their sha256: a blob whose bytes do
    not hash to its name is a damaged download and gets no manifest."""
    import hashlib

    repo = tmp_path / "models--pfnet--plamo-2-1b"  # the cache's layout: snapshots/<rev> -> ../../blobs
    src = repo / "snapshots" / ("a" * 40)
    shutil.copytree(checkpoint("tiny", values="watermark"), src)
    blobs = repo / "blobs"
    blobs.mkdir()
    weights = src / "model.safetensors"
    good = hashlib.sha256(weights.read_bytes()).hexdigest()
    wrong = blobs / ("0" * 64)
    weights.rename(wrong)
    weights.symlink_to(wrong)
    _fails(cli, src, tmp_path / "out", code=2, says="differs from its Hugging Face cache blob name")
    _no_manifest(tmp_path / "out")
    right = blobs / good
    wrong.rename(right)
    weights.unlink()
    weights.symlink_to(right)
    cli("convert", src, tmp_path / "out2", "--json")
