"""Issue 21, class 4: every file copied into a shard directory (config, generation config,
tokenizer files, ...) is in the manifest with its size and digest (format 3), checked by `check`,
at load and before resharding or merging; a changed one is refused naming it.  Before: an edited
config.json or tokenizer.jsonl passed `check`, was used silently by `generate`, and an edited
config was resharded into a fresh manifest that `check` passed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import xxhash

MANIFEST = "plamo2_shards.json"


def test_manifest_records_every_copied_file(tiny_shards: Path) -> None:
    """Recomputed here with xxhash itself: H(bytes) of each copied file, and its size."""
    m = json.loads((tiny_shards / MANIFEST).read_text())
    assert m["format_version"] == 3
    assert (
        set(m["side_files"]) == set(m["copied_files"]) >= {"config.json", "tokenizer.jsonl", "generation_config.json"}
    )
    for name, rec in m["side_files"].items():
        data = (tiny_shards / name).read_bytes()
        assert rec == {"size": len(data), "digest": xxhash.xxh3_128(data).hexdigest()}, name


def _edit(path: Path, name: str) -> None:
    """A change a user (or an attacker) could make and that still parses."""
    if name == "tokenizer.jsonl":
        lines = path.read_text().splitlines()
        lines[300], lines[301] = lines[301], lines[300]  # two pieces swap ids
        path.write_text("\n".join(lines) + "\n")
    elif name == "config.json":
        cfg = json.loads(path.read_text())
        cfg["rope_theta"] = 12345.0  # still a valid config of the same shapes
        path.write_text(json.dumps(cfg))
    else:
        cfg = json.loads(path.read_text())
        cfg["eos_token_id"] = 7
        path.write_text(json.dumps(cfg))


@pytest.mark.parametrize("name", ["tokenizer.jsonl", "config.json", "generation_config.json"])
def test_changed_side_file_is_refused(run, one_line_error, tiny_shards, work, outside, name: str) -> None:
    shards = work / "shards"
    shutil.copytree(tiny_shards, shards)
    _edit(shards / name, name)
    r = run("check", shards)
    assert r.returncode == 1 and "Traceback" not in r.stderr + r.stdout
    assert f"{name}: changed since the conversion" in r.stdout, r.stdout
    for args in (
        ["generate", shards, "--prompt", "hello", "--max-new-tokens", 2],
        ["convert", shards, work / "tp1", "--tp", 1],
        ["merge", shards, work / "merged"],
    ):
        line = one_line_error(run(*args), 2)
        assert f"{name}: changed since the conversion" in line, (args, line)
    assert not (work / "tp1" / MANIFEST).exists() and not (work / "merged" / "config.json").exists()


def test_side_file_replaced_by_a_link(run, one_line_error, tiny_shards, work, outside) -> None:
    """Same bytes, but a link to a file outside: not a file of the shard directory."""
    shards = work / "shards"
    shutil.copytree(tiny_shards, shards)
    shutil.move(shards / "tokenizer.jsonl", outside.path / "tokenizer.jsonl")
    outside.retake()
    (shards / "tokenizer.jsonl").symlink_to(outside.path / "tokenizer.jsonl")
    line = one_line_error(run("generate", shards, "--prompt", "hi", "--max-new-tokens", 1), 2)
    assert "tokenizer.jsonl: is a symbolic link" in line


def test_reshard_copies_only_recorded_side_files(cli, tiny_shards, work) -> None:
    """A file dropped into a shard directory later is not part of it: resharding does not carry
    it into the new directory (whose manifest would otherwise vouch for it)."""
    shards = work / "shards"
    shutil.copytree(tiny_shards, shards)
    (shards / "tokenization_evil.py").write_text("import os\n")
    cli("convert", shards, work / "tp1", "--tp", 1, "--json")
    assert not (work / "tp1" / "tokenization_evil.py").exists()
    m = json.loads((work / "tp1" / MANIFEST).read_text())
    assert set(m["side_files"]) == set(json.loads((shards / MANIFEST).read_text())["side_files"])
