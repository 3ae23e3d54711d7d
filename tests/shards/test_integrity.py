"""Format version 2's digests (issue 13) and version 1 still read and checked.

The digests are recomputed here from the file bytes with hashlib/xxhash and our own header
parsing, by the rules docs/shard-format.md states, never with plamo2_tools' digest code.  Version
1 is the directory in fixtures/, written by the version-1 converter itself (fixtures/README.md).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from pathlib import Path

import pytest
import xxhash
from convert_expect import flip_byte

from plamo2_tools.convert import engine
from plamo2_tools.errors import CheckpointError
from plamo2_tools.shards.manifest import JOURNAL_NAME, MANIFEST_NAME, load_manifest

V1 = Path(__file__).parent / "fixtures" / "v1-tiny-edge-tp2pp2"
V2 = Path(__file__).parent / "fixtures" / "v2-tiny-edge-tp2pp2"  # written by main before format 3
OLD = {1: V1, 2: V2}


def independent_digests(path: Path, version: int, v2_hash=xxhash.xxh3_128) -> tuple[str, dict[str, str]]:
    """(file digest, {tensor: digest}) as docs/shard-format.md defines them for `version`."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header.pop("__metadata__", None)
    start = 8 + n
    ranges = sorted((start + e["data_offsets"][0], start + e["data_offsets"][1], k) for k, e in header.items())
    if version == 1:
        return hashlib.sha256(data).hexdigest(), {k: hashlib.sha256(data[a:b]).hexdigest() for a, b, k in ranges}
    whole = v2_hash(data[:start])
    tensors = {}
    for a, b, k in ranges:
        tensors[k] = v2_hash(data[a:b]).hexdigest()
        whole.update(v2_hash(data[a:b]).digest())
    return whole.hexdigest(), tensors


def _same_files(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.glob("model-rank-*"))
    assert names and names == sorted(p.name for p in b.glob("model-rank-*"))
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.fixture(params=[1, 2, 3], ids=["v1", "v2", "v3"])
def either_version(request: pytest.FixtureRequest, shards, private_copy) -> Path:
    """A private copy of tiny-edge at tp 2 x pp 2 in either format version (same layout: ranks 0/1
    and 2/3 have files of equal size, so a swap keeps every size right)."""
    out = private_copy(OLD.get(request.param) or shards("tiny-edge", 2, 2, values="watermark"))
    assert json.loads((out / MANIFEST_NAME).read_text())["format_version"] == request.param
    return out


def _failed(cli, path: Path) -> dict[str, list[str]]:
    report = json.loads(cli("check", path, "--json", expect=1).stdout)
    return {name: found for name, found in report["checks"].items() if found}


# ---- what convert records -----------------------------------------------------------------------
def test_streamed_digests_equal_digests_of_finished_files(cli, checkpoint, tmp_path: Path) -> None:
    """Every digest in the manifest (files, tensors, input files), computed while copying, equals
    the digest of the finished file's bytes; several parts, padding, gathers, constants."""
    src = checkpoint("tiny-gqa", values="watermark")
    out = tmp_path / "out"
    result = json.loads(cli("convert", src, out, "--tp", 2, "--pp", 2, "--max-part-size", "200kB", "--json").stdout)
    assert all(result["copy"]["bytes"][k] > 0 for k in ("copy_file_range", "gather", "compute", "zeros"))
    m = json.loads((out / MANIFEST_NAME).read_text())
    assert (m["format_version"], m["hash"]) == (3, "xxh3-128")
    assert len(m["files"]) > 4
    for name, rec in m["files"].items():
        whole, tensors = independent_digests(out / name, 2)
        assert rec["digest"] == whole, name
        recorded = {k: t["digest"] for k, t in m["tensors"][str(rec["rank"])].items() if t["file"] == name}
        assert recorded == tensors, name
    assert m["source"]["files"] == {
        "model.safetensors": {
            "size": (src / "model.safetensors").stat().st_size,
            "digest": independent_digests(src / "model.safetensors", 2)[0],
        }
    }


def test_resume_reverifies_finished_files(cli, medium_checkpoint: Path, tmp_path: Path, interrupt) -> None:
    """Interrupted after some files were journaled; one of them is then damaged without changing
    its size.  The rerun hashes every journaled file again: the damaged one is rewritten, the
    others kept, and the result equals an uninterrupted conversion."""
    split = ("--tp", 2, "--pp", 2, "--max-part-size", "1MB")
    cli("convert", medium_checkpoint, tmp_path / "reference", *split, "--json")
    restore = interrupt(engine, "_stream_unit", on_call=6)
    out = tmp_path / "out"
    cli("convert", medium_checkpoint, out, *split, expect=130)
    restore()
    journaled = [json.loads(line) for line in (out / JOURNAL_NAME).read_text().splitlines()[1:]]
    assert len(journaled) >= 4
    for rec in journaled:  # the journal holds version 2 digests of the finished files
        assert rec["digest"] == independent_digests(out / rec["file"], 2)[0]
    damaged = journaled[1]["file"]
    flip_byte(out / damaged, -7)
    result = json.loads(cli("convert", medium_checkpoint, out, *split, "--json").stdout)
    assert result["status"] == "resumed"
    assert damaged not in result["files_reused"]
    assert {r["file"] for r in journaled} - {damaged} <= set(result["files_reused"])
    _same_files(out, tmp_path / "reference")
    cli("check", out, "--json")


# ---- check under both versions -------------------------------------------------------------------
def test_good_directory_passes(cli, either_version: Path) -> None:
    assert json.loads(cli("check", either_version, "--json").stdout)["ok"] is True


def test_flipped_byte_in_a_tensor(cli, either_version: Path) -> None:
    m = load_manifest(either_version)
    name = "model-rank-1-part-0.safetensors"
    data = (either_version / name).read_bytes()
    flip_byte(either_version / name, len(data) - 3)  # inside the file's last tensor
    failed = _failed(cli, either_version)
    assert set(failed) == {"files", "tensors"}
    assert failed["files"] == [f"{name}: {m.hash} digest differs from the manifest (damaged or replaced file?)"]
    assert len(failed["tensors"]) == 1 and failed["tensors"][0].startswith("rank 1: ")


def test_flipped_byte_in_a_header(cli, either_version: Path) -> None:
    """The header is covered too: a changed writer version (which no other check looks at) keeps
    the file valid, its tensors intact, and still fails the file digest."""
    name = "model-rank-2-part-0.safetensors"
    data = bytearray((either_version / name).read_bytes())
    at = data.index(b'"plamo2_tools_version":"') + len(b'"plamo2_tools_version":"')
    data[at] = ord("7") if data[at] != ord("7") else ord("8")
    (either_version / name).write_bytes(bytes(data))
    failed = _failed(cli, either_version)
    assert set(failed) == {"files"} and failed["files"][0].startswith(name)


def test_truncated_file(cli, either_version: Path) -> None:
    name = "model-rank-3-part-0.safetensors"
    with open(either_version / name, "r+b") as f:
        f.truncate((either_version / name).stat().st_size - 100)
    failed = _failed(cli, either_version)
    assert any(p.startswith(f"{name}: size") for p in failed["files"])


def test_swapped_files(cli, either_version: Path) -> None:
    """Two ranks' files of the same size swapped: both digests differ, and the headers say whose
    they are."""
    a, b = (either_version / f"model-rank-{r}-part-0.safetensors" for r in (0, 1))
    assert a.stat().st_size == b.stat().st_size
    tmp = either_version / "swap"
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)
    failed = _failed(cli, either_version)
    assert sorted(p.split(":")[0] for p in failed["files"]) == [a.name, b.name]
    assert "headers" in failed


# ---- version 1 -----------------------------------------------------------------------------------
def test_version_1_is_read_as_written(tmp_path: Path) -> None:
    m = load_manifest(V1)
    assert (m.version, m.hash) == (1, "sha256")
    for name in m.files:
        whole, tensors = independent_digests(V1 / name, 1)
        assert m.file_digest(name) == whole
        rank = m.files[name].rank
        assert {k: e.digest for k, e in m.entries[rank].items() if e.file == name} == tensors
        assert m.digests_of(V1 / name) == (whole, tensors)


@pytest.mark.parametrize("version", [1, 2])
def test_older_versions_reshard_and_merge(cli, tmp_path: Path, version: int) -> None:
    """An older directory as a source: verified by its own digests, recorded by the current rule
    (format 3, with its side files' digests)."""
    old = OLD[version]
    out = tmp_path / "tp1"
    cli("convert", old, out, "--tp", 1, "--pp", 1, "--json")
    m = json.loads((out / MANIFEST_NAME).read_text())
    assert m["format_version"] == 3 and m["source"]["kind"] == "shards"
    assert m["source"]["files"] == {
        name: {"size": (old / name).stat().st_size, "digest": independent_digests(old / name, 2)[0]}
        for name in load_manifest(old).files
    }
    assert set(m["side_files"]) == {"config.json", "generation_config.json"}
    cli("check", out, "--json")
    cli("merge", old, tmp_path / "merged", "--json")
    damaged = tmp_path / "damaged"
    shutil.copytree(old, damaged)
    flip_byte(damaged / "model-rank-0-part-0.safetensors", -5)
    r = cli("convert", damaged, tmp_path / "never", "--tp", 1, expect=2)
    algorithm = "sha256" if version == 1 else "xxh3-128"
    assert f"{algorithm} digest differs from the manifest" in " ".join(r.stderr.split())


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        ({"format_version": 4}, "format_version 4 is not supported"),
        ({"hash": "md5"}, "unknown hash algorithm 'md5'"),
    ],
)
def test_unknown_version_or_hash_is_refused(cli, checkpoint, tmp_path: Path, edit: dict, says: str) -> None:
    out = tmp_path / "out"
    cli("convert", checkpoint("tiny", values="watermark"), out, "--json")
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    (out / MANIFEST_NAME).write_text(json.dumps({**manifest, **edit}))
    with pytest.raises(CheckpointError, match=says):
        load_manifest(out)
    r = cli("check", out, expect=2)
    assert says in r.stderr


def test_version_2_with_sha256_named_is_checked_by_it(cli, checkpoint, tmp_path: Path) -> None:
    """The algorithm is whatever `hash` names: the same directory with every digest rewritten in
    SHA-256 (by version 2's rules) passes `check`, and a flipped byte still fails it."""
    out = tmp_path / "out"
    cli("convert", checkpoint("tiny-gqa", values="watermark"), out, "--tp", 2, "--json")
    m = json.loads((out / MANIFEST_NAME).read_text())
    m["hash"] = "sha256"
    for name, rec in m["files"].items():
        whole, tensors = independent_digests(out / name, 2, hashlib.sha256)
        rec["digest"] = whole
        for key, digest in tensors.items():
            m["tensors"][str(rec["rank"])][key]["digest"] = digest
    for name, rec in m["side_files"].items():
        rec["digest"] = hashlib.sha256((out / name).read_bytes()).hexdigest()
    (out / MANIFEST_NAME).write_text(json.dumps(m))
    assert load_manifest(out).hash == "sha256"
    assert json.loads(cli("check", out, "--json").stdout)["ok"] is True
    flip_byte(out / "model-rank-0-part-0.safetensors", -3)
    assert _failed(cli, out)["files"] == [
        "model-rank-0-part-0.safetensors: sha256 digest differs from the manifest (damaged or replaced file?)"
    ]
