"""Issue 21, class 1: a file name read from a file (manifest, journal, HF index, written-record) is
a plain name inside its directory; anything else is refused with exit 2 naming the file and the
entry, before anything is read through it or deleted by it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from plamo2_tools.safe_files import name_problem

MANIFEST = "plamo2_shards.json"
JOURNAL = ".plamo2_convert.journal.jsonl"


@pytest.mark.parametrize(
    ("name", "plain"),
    [
        ("model-rank-0-part-0.safetensors", True),
        ("config.json", True),
        ("..", False),
        (".", False),
        ("", False),
        ("../x", False),
        ("/etc/passwd", False),
        ("a/b", False),
        ("a\\b", False),
        ("a\0b", False),
        (3, False),
        ("x" * 256, False),
        ("..x", True),
    ],
)
def test_the_rule(name: object, plain: bool) -> None:
    assert (name_problem(name) is None) is plain


def _rename_shard(shards: Path, old: str, new: str) -> None:
    """The manifest names shard file `old` as `new` everywhere it lists it (files, ranks, tensors)."""
    path = shards / MANIFEST
    m = json.loads(path.read_text())
    m["files"][new] = m["files"].pop(old)
    for r in m["mapping"]["ranks"]:
        r["files"] = [new if f == old else f for f in r["files"]]
    for tensors in m["tensors"].values():
        for rec in tensors.values():
            if rec["file"] == old:
                rec["file"] = new
    path.write_text(json.dumps(m))


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


SHARD = "model-rank-1-part-0.safetensors"


def test_manifest_naming_a_file_outside(run, one_line_error, tiny_shards, work, outside) -> None:
    """The shard file moved outside and the manifest pointing at it with `..`: check, generate,
    merge and reshard all refuse, naming the manifest and the entry (before: check said
    "complete and matches its manifest" and generate ran the outside file)."""
    shards = _copy(tiny_shards, work / "shards")
    shutil.move(shards / SHARD, outside.path / SHARD)
    outside.retake()  # the moved shard file is now part of what must not change
    _rename_shard(shards, SHARD, f"../outside/{SHARD}")
    for args in (
        ["check", shards],
        ["generate", shards, "--prompt", "hi", "--max-new-tokens", 2],
        ["merge", shards, work / "merged"],
        ["convert", shards, work / "tp1", "--tp", 1],
    ):
        line = one_line_error(run(*args), 2)
        assert f"{MANIFEST}: " in line and f"entry '../outside/{SHARD}' is not a plain file name" in line, line
    assert not (work / "merged" / "config.json").exists() and not (work / "tp1" / MANIFEST).exists()


@pytest.mark.parametrize("name", ["/etc/hostname", "sub/x.safetensors", "..", "a\\b"])
def test_manifest_names_that_are_not_plain(run, one_line_error, tiny_shards, work, outside, name: str) -> None:
    """Absolute names crashed merge and convert with a bug exit; every such name is exit 2."""
    shards = _copy(tiny_shards, work / "shards")
    _rename_shard(shards, SHARD, name)
    for args in (["check", shards], ["merge", shards, work / "merged"]):
        line = one_line_error(run(*args), 2)
        assert "is not a plain file name" in line and MANIFEST in line, line


def test_copied_files_entry_outside(run, one_line_error, tiny_shards, work, outside) -> None:
    shards = _copy(tiny_shards, work / "shards")
    m = json.loads((shards / MANIFEST).read_text())
    m["copied_files"].append("../outside/secret.txt")
    (shards / MANIFEST).write_text(json.dumps(m))
    line = one_line_error(run("merge", shards, work / "merged"), 2)
    assert "copied_files: entry '../outside/secret.txt' is not a plain file name" in line


def test_journal_naming_a_file_outside(run, one_line_error, checkpoint, work, outside) -> None:
    """A journal decides what a re-run deletes: a `..` entry in `writes` is refused (exit 2), and
    the file it names is still there."""
    out = work / "out"
    out.mkdir()
    (out / JOURNAL).write_text(json.dumps({"fingerprint": "x", "writes": ["../../outside/secret.txt"]}) + "\n")
    for args in (["convert", checkpoint("tiny"), out], ["convert", checkpoint("tiny"), out, "--force"]):
        line = one_line_error(run(*args), 2)
        assert f"{JOURNAL}: entry '../../outside/secret.txt' is not a plain file name" in line, line
    assert not (out / MANIFEST).exists()


def test_journal_finished_record_outside(run, one_line_error, checkpoint, work, outside) -> None:
    out = work / "out"
    out.mkdir()
    rows = [{"fingerprint": "x", "writes": []}, {"file": str(outside.secret), "size": 1, "digest": "0"}]
    (out / JOURNAL).write_text("".join(json.dumps(r) + "\n" for r in rows))
    line = one_line_error(run("convert", checkpoint("tiny"), out, "--force"), 2)
    assert f"entry '{outside.secret}' is not a plain file name" in line


def test_hf_index_naming_a_file_outside(run, one_line_error, checkpoint, work, outside) -> None:
    """An HF checkpoint whose index maps tensors to `../outside/model.safetensors`: refused
    before the outside file is opened."""
    src = _copy(checkpoint("tiny", files=2), work / "ckpt")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    shutil.copy(src / first, outside.path / "model.safetensors")
    outside.retake()
    hostile = "../outside/model.safetensors"
    index["weight_map"] = {k: (hostile if v == first else v) for k, v in index["weight_map"].items()}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    for args in (["convert", src, work / "out"], ["inspect", src]):
        line = one_line_error(run(*args), 2)
        assert "model.safetensors.index.json: entry '../outside/model.safetensors' is not a plain file name" in line


def test_written_record_naming_a_file_outside(run, one_line_error, tiny_shards, work, outside) -> None:
    """merge's and synth's `.plamo2_written.json` says what --force deletes: a `..` entry is
    refused and the file it names survives --force."""
    out = work / "merged"
    out.mkdir()
    record = {
        "format": "plamo2-written",
        "command": "merge",
        "status": "complete",
        "source": "x",
        "files": ["../outside/secret.txt", "config.json"],
    }
    (out / ".plamo2_written.json").write_text(json.dumps(record))
    for args in (["merge", tiny_shards, out, "--force"], ["synth", out, "--preset", "tiny", "--force"]):
        line = one_line_error(run(*args), 2)
        assert ".plamo2_written.json: entry '../outside/secret.txt' is not a plain file name" in line, line
