"""Issue 21, class 2: never follow what we did not create.  The lock, temporaries, the journal and
`.partial` files are opened without following links and created fresh; a FIFO, socket or
directory where a file is expected is refused at once (never a blocking open); a source's
symlinks may point only inside the source directory or its Hugging Face cache repository.

Each planted link points at `outside.secret`; the `outside` fixture checks its bytes (and the
whole sibling directory) at the end of every test."""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

import pytest

MANIFEST = "plamo2_shards.json"
JOURNAL = ".plamo2_convert.journal.jsonl"
LOCK = ".plamo2.lock"


def _interrupted_conversion(cli, src: Path, out: Path) -> list[str]:
    """OUT as a convert killed after planning leaves it: the journal (with the plan's real
    fingerprint and writes), no manifest, no finished file.  Returns the journal's writes."""
    cli("convert", src, out, "--json")
    manifest = json.loads((out / MANIFEST).read_text())
    writes = [*manifest["files"], *manifest["copied_files"], MANIFEST]
    for name in writes:
        (out / name).unlink()
    (out / JOURNAL).write_text(json.dumps({"fingerprint": manifest["fingerprint"], "writes": writes}) + "\n")
    return writes


def test_lock_planted_as_a_symlink(run, one_line_error, checkpoint, tiny_shards, work, outside) -> None:
    """convert and merge truncated the file a planted lock pointed to, then exited 0."""
    for args, out in ((["convert", checkpoint("tiny")], work / "out"), (["merge", tiny_shards], work / "merged")):
        out.mkdir()
        (out / LOCK).symlink_to(outside.secret)
        line = one_line_error(run(*args, out), 2)
        assert f"{LOCK}: is a symbolic link" in line, line  # refused before the lock is taken
        assert not (out / MANIFEST).exists() and not (out / "config.json").exists()


def test_lock_planted_in_a_shard_directory_is_refused_by_readers(
    run, one_line_error, tiny_shards, work, outside
) -> None:
    shards = work / "shards"
    shutil.copytree(tiny_shards, shards)
    (shards / LOCK).symlink_to(outside.secret)
    line = one_line_error(run("check", shards), 2)
    assert f"{LOCK}: is a symbolic link, not a regular file" in line


@pytest.mark.parametrize("kind", ["fifo", "socket", "directory"])
def test_lock_that_is_not_a_file(run, one_line_error, tiny_shards, checkpoint, work, outside, kind: str) -> None:
    """A FIFO where the lock should be made `check` hang forever: now every reader and writer is
    refused at once (the subprocess has 60 s; a hang fails the test)."""
    shards = work / "shards"
    shutil.copytree(tiny_shards, shards)
    out = work / "out"
    out.mkdir()
    holders = []
    for d in (shards, out):
        path = d / LOCK
        if kind == "fifo":
            os.mkfifo(path)
        elif kind == "socket":
            s = socket.socket(socket.AF_UNIX)
            s.bind(str(path))
            holders.append(s)
        else:
            path.mkdir()
    try:
        for args in (
            ["check", shards],
            ["generate", shards, "--prompt", "x", "--max-new-tokens", 1],
            ["convert", checkpoint("tiny"), out],
        ):
            line = one_line_error(run(*args, timeout=60), 2)
            assert LOCK in line and "regular file" in line, (args, line)
    finally:
        for s in holders:
            s.close()


def test_planted_journal_is_not_followed(run, one_line_error, checkpoint, work, outside) -> None:
    out = work / "out"
    out.mkdir()
    (out / JOURNAL).symlink_to(outside.secret)
    line = one_line_error(run("convert", checkpoint("tiny"), out, "--force"), 2)
    assert JOURNAL in line and "symbolic link" in line


def test_planted_temporaries_on_resume(cli, run, checkpoint, work, outside) -> None:
    """A resumed conversion with links planted at its `.partial`, `.tmp` and journal-temporary
    names: it finishes (exit 0), writes none of them through, and config.json is a regular file
    (before: it became a link to the outside file)."""
    out = work / "out"
    writes = _interrupted_conversion(cli, checkpoint("tiny"), out)
    planted = [f"{n}.partial" for n in writes if n.endswith(".safetensors")] + [
        "config.json.tmp",
        "tokenizer.jsonl.tmp",
        f"{MANIFEST}.tmp",
        f"{JOURNAL}.tmp",
    ]
    for name in planted:
        (out / name).symlink_to(outside.secret)
    r = run("convert", checkpoint("tiny"), out, "--json")
    assert r.returncode == 0, r.stderr
    assert not (out / "config.json").is_symlink() and (out / "config.json").is_file()
    # Only the journal's temporary is still a link (the run resumed; it never started a journal).
    assert [p.name for p in out.iterdir() if p.is_symlink()] == [f"{JOURNAL}.tmp"]
    assert run("check", out).returncode == 0


def test_planted_temporaries_in_a_fresh_output(run, one_line_error, checkpoint, work, outside) -> None:
    """In a directory that is not ours, a link at one of our temporary names is someone else's
    file in the way: refused, nothing written."""
    out = work / "out"
    out.mkdir()
    (out / "config.json.tmp").symlink_to(outside.secret)
    line = one_line_error(run("convert", checkpoint("tiny"), out, "--force"), 2)
    assert "config.json.tmp" in line and "did not write" in line


def test_merge_output_with_planted_links(run, one_line_error, tiny_shards, work, outside) -> None:
    out = work / "merged"
    out.mkdir()
    (out / "model.safetensors.partial").symlink_to(outside.secret)
    line = one_line_error(run("merge", tiny_shards, out, "--force"), 2)
    assert "model.safetensors.partial" in line


def test_report_temporary_is_not_followed(run, tiny_shards, work, outside) -> None:
    (work / "check.json").write_text(run("check", tiny_shards, "--json").stdout)
    (work / ".report.md.partial").symlink_to(outside.secret)
    r = run("report", work / "check.json", "--out", work / "report.md")
    assert r.returncode == 0, r.stderr
    assert (work / "report.md").is_file() and not (work / "report.md").is_symlink()


def test_tokenize_partial_is_not_followed(run, tiny_shards, work, outside) -> None:
    (work / "ids.jsonl.partial").symlink_to(outside.secret)
    r = run("tokenize", tiny_shards, "--out", work / "ids.jsonl", input='"hello"\n')
    assert r.returncode == 0, r.stderr
    assert (work / "ids.jsonl").read_text().startswith("[")


# ---- sources ------------------------------------------------------------------------------------
def test_source_side_file_linking_outside(run, one_line_error, checkpoint, work, outside) -> None:
    """A README.md that links to a private file was copied into the shards as a regular file."""
    src = work / "ckpt"
    shutil.copytree(checkpoint("tiny"), src)
    (src / "README.md").symlink_to(outside.secret)
    line = one_line_error(run("convert", src, work / "out"), 2)
    assert "README.md: a symbolic link to" in line and "outside" in line
    assert not (work / "out" / MANIFEST).exists()


def test_source_weights_linking_outside(run, one_line_error, checkpoint, work, outside) -> None:
    src = work / "ckpt"
    shutil.copytree(checkpoint("tiny"), src)
    shutil.move(src / "model.safetensors", outside.path / "model.safetensors")
    outside.retake()
    (src / "model.safetensors").symlink_to(outside.path / "model.safetensors")
    line = one_line_error(run("convert", src, work / "out"), 2)
    assert "model.safetensors: a symbolic link to" in line


def test_hugging_face_cache_layout_keeps_working(run, checkpoint, work) -> None:
    """snapshots/<rev>/NAME -> ../../blobs/<sha256>: every file of the checkpoint (weights,
    config, tokenizer) a link into the repository's blobs, as huggingface_hub lays it out."""
    import hashlib

    repo = work / "hub" / "models--pfnet--plamo-2-tiny"
    snapshot, blobs = repo / "snapshots" / ("c" * 40), repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for f in checkpoint("tiny").iterdir():
        if f.name.startswith("."):
            continue
        blob = blobs / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copy(f, blob)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    r = run("convert", snapshot, work / "out", "--tp", 2)
    assert r.returncode == 0, r.stderr
    assert run("check", work / "out").returncode == 0
    assert not (work / "out" / "config.json").is_symlink()


def test_shard_file_linking_outside(run, one_line_error, tiny_shards, work, outside) -> None:
    """A shard directory whose file is a link out of it: not a shard of it (check: exit 1 naming
    it; the runtime and resharding: exit 2)."""
    shards = work / "shards"
    shutil.copytree(tiny_shards, shards)
    name = "model-rank-0-part-0.safetensors"
    shutil.move(shards / name, outside.path / name)
    outside.retake()
    (shards / name).symlink_to(outside.path / name)
    r = run("check", shards)
    assert r.returncode == 1 and "Traceback" not in r.stderr + r.stdout
    assert f"{name}: a symbolic link to" in r.stdout, r.stdout
    line = one_line_error(run("convert", shards, work / "tp1", "--tp", 1), 2)
    assert f"{name}: a symbolic link to" in line
