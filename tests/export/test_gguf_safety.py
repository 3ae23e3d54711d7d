"""`export gguf` and `check FILE.gguf` on hostile input (issue 31, "Hostile input as for convert"):
whatever stands at OUT, a link planted at the temporary name, an interrupted or disk-full export,
a source that reaches outside itself, bad options; a tampered export that `check` must catch.
Every refusal is one line with its exit code, and nothing that looks complete is left behind.

No llama.cpp needed (every export here is --no-verify).  Seen failing: with check_output's
ownership test removed (the foreign file is overwritten), with create_fresh replaced by open(path,
"wb") (the planted link's target is written), with the partial left on an exception (interrupt and
ENOSPC leave OUT.partial), with the free-space check skipped (the small tmpfs fills, ENOSPC instead
of the up-front refusal), with check comparing only tensor names (tampered bytes pass).
"""

from __future__ import annotations

import errno
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from plamo2_tools.export import gguf_plan
from plamo2_tools.export.gguf import side_file


def _export(cli, src: Path, out: Path, *args: str, expect: int = 0):
    return cli("export", "gguf", src, out, "--type", "f32", "--no-verify", *args, expect=expect)


def _leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir())


def test_a_link_at_out_is_refused_and_its_target_untouched(cli, checkpoint, tmp_path, one_line_error) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    out = tmp_path / "m.gguf"
    out.symlink_to(victim)
    line = one_line_error(_export(cli, checkpoint("tiny3"), out, expect=2), 2)
    assert "symbolic link" in line
    assert victim.read_text() == "mine" and out.is_symlink()


def test_a_file_not_ours_is_never_replaced(cli, checkpoint, tmp_path, one_line_error) -> None:
    out = tmp_path / "m.gguf"
    out.write_bytes(b"GGUF not really")
    for extra in ((), ("--force",)):
        line = one_line_error(_export(cli, checkpoint("tiny3"), out, *extra, expect=2), 2)
        assert "not written by plamo2-tools" in line
    assert out.read_bytes() == b"GGUF not really"
    assert _leftovers(out) == ["m.gguf"]


def test_ours_is_replaced_with_force_only(cli, checkpoint, tmp_path, one_line_error) -> None:
    out = tmp_path / "m.gguf"
    _export(cli, checkpoint("tiny3"), out)
    first = json.loads(side_file(out).read_text())
    one_line_error(_export(cli, checkpoint("tiny3", seed=1), out, expect=2), 2)
    _export(cli, checkpoint("tiny3", seed=1), out, "--force")
    second = json.loads(side_file(out).read_text())
    assert first["xxh3-128"] != second["xxh3-128"]
    assert _leftovers(out) == ["m.gguf", side_file(out).name]


def test_a_link_planted_at_the_partial_name_is_replaced_not_followed(cli, checkpoint, tmp_path) -> None:
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"precious")
    out = tmp_path / "m.gguf"
    (tmp_path / "m.gguf.partial").symlink_to(victim)
    _export(cli, checkpoint("tiny3"), out)
    assert victim.read_bytes() == b"precious"
    assert gguf.GGUFReader(str(out)).fields["general.architecture"].contents() == "plamo3"
    assert not (tmp_path / "m.gguf.partial").exists()


def test_interrupted_export_leaves_nothing(cli, checkpoint, tmp_path, interrupt, one_line_error) -> None:
    out = tmp_path / "m.gguf"
    interrupt(gguf_plan, "quantize", on_call=5)
    # --json: no progress bar, so the interruption's line is the only one on stderr
    one_line_error(_export(cli, checkpoint("tiny"), out, "--json", expect=130), 130, prefix="interrupted:")
    assert _leftovers(out) == []


def test_disk_full_while_writing(cli, checkpoint, tmp_path, monkeypatch, one_line_error) -> None:
    """The disk fills half way (the free-space check passed, then something else took the room)."""
    real, calls = os.write, [0]

    def write(fd: int, data) -> int:
        calls[0] += 1
        if calls[0] > 20:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)
    out = tmp_path / "m.gguf"
    line = one_line_error(_export(cli, checkpoint("tiny"), out, "--json", expect=3), 3)
    assert "no space left on device" in line and str(out) in line
    monkeypatch.setattr(os, "write", real)
    assert _leftovers(out) == []


def test_a_small_filesystem_is_refused_before_writing(checkpoint, tmp_path, one_line_error) -> None:
    """A real 64 KiB tmpfs (a private mount namespace, as tests/security/test_free_space.py)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    argv = [sys.executable, "-m", "plamo2_tools.cli", "export", "gguf", checkpoint("tiny"), mnt / "m.gguf"]
    cmd = " ".join(shlex.quote(str(a)) for a in [*argv, "--no-verify", "--type", "f32"])
    script = f"mount -t tmpfs -o size=64k tmpfs {shlex.quote(str(mnt))} && {cmd}; echo left=$(ls -A {mnt}) >&2"
    env = dict(os.environ, COLUMNS="250", NO_COLOR="1", PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    try:
        r = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=300, env=env)
    except OSError:
        pytest.skip("no unshare here")
    if "mount:" in r.stderr or "unshare:" in r.stderr:
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {r.stderr.strip()[:120]}")
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 0 and lines[-1] == "left=", r.stderr  # the shell's exit; nothing left on the mount
    assert len(lines) == 2 and lines[0].startswith("error:") and "not enough disk space" in lines[0], r.stderr


def test_a_source_file_linked_outside_the_source_is_refused(
    cli, checkpoint, private_copy, tmp_path, one_line_error
) -> None:
    src = private_copy(checkpoint("tiny3"))
    outside = tmp_path / "elsewhere.jsonl"
    outside.write_bytes((src / "tokenizer.jsonl").read_bytes())
    (src / "tokenizer.jsonl").unlink()
    (src / "tokenizer.jsonl").symlink_to(outside)
    out = tmp_path / "m.gguf"
    line = one_line_error(_export(cli, src, out, expect=2), 2)
    assert "tokenizer.jsonl" in line
    assert not out.exists() and not Path(str(out) + ".partial").exists()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--tensor-type", "ssm_out"), "expected PATTERN=TYPE"),
        (("--tensor-type", "ssm_out=q3_k"), "type 'q3_k' is not one of"),
        (("--tensor-type", "ssm_(out=f16"), "bad pattern"),
        (("--recipe", "ssm-out-f16"), "not a recipe of this model"),  # a PLaMo 2 recipe on PLaMo 3
        (("--type", "q9_9"), "--type 'q9_9'"),
    ],
)
def test_bad_options_are_one_line(cli, checkpoint, tmp_path, one_line_error, args, says) -> None:
    out = tmp_path / "m.gguf"
    r = cli("export", "gguf", checkpoint("tiny3"), out, "--no-verify", *args, expect=2)
    assert says in one_line_error(r, 2)
    assert _leftovers(out) == []


def test_a_k_quant_without_llama_quantize_is_refused(cli, checkpoint, tmp_path, monkeypatch, one_line_error) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no llama-quantize anywhere
    r = cli("export", "gguf", checkpoint("tiny3"), tmp_path / "m.gguf", "--type", "q4_k_m", expect=3)
    assert "llama-quantize" in one_line_error(r, 3)


# ---- check FILE.gguf --source -------------------------------------------------------------------------
def test_check_passes_an_export_and_names_a_tampered_tensor_and_key(cli, checkpoint, tmp_path, one_line_error) -> None:
    src = checkpoint("tiny3")
    out = tmp_path / "m.gguf"
    _export(cli, src, out)
    cli("check", out, "--source", src)
    reader = gguf.GGUFReader(str(out))
    target = next(t for t in reader.tensors if t.name == "blk.1.attn_qkv.weight")
    offset = reader.data_offset + int(target.data_offset) + 4 * 37
    del reader
    with open(out, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))
    line = one_line_error(cli("check", out, "--source", src, expect=1), 1)
    assert "blk.1.attn_qkv.weight" in line
    with open(out, "r+b") as f:  # restore, then edit a key the way gguf's own tools do
        f.seek(offset)
        f.write(byte)
    reader = gguf.GGUFReader(str(out), "r+")
    field = reader.fields["plamo3.rope.freq_base"]
    field.parts[field.data[0]][0] = 5000.0
    del reader
    line = one_line_error(cli("check", out, "--source", src, expect=1), 1)
    assert "plamo3.rope.freq_base" in line


def test_check_of_a_gguf_needs_the_source(cli, checkpoint, tmp_path, one_line_error) -> None:
    out = tmp_path / "m.gguf"
    _export(cli, checkpoint("tiny3"), out)
    assert "--source" in one_line_error(cli("check", out, expect=2), 2)


def test_a_vocabulary_piece_that_is_not_unicode_is_one_line(
    cli, checkpoint, private_copy, tmp_path, one_line_error
) -> None:
    """JSON allows a lone surrogate ("\\ud800"), UTF-8 cannot hold it (llama.cpp's converter crashes
    on it).  Seen failing (exit 70, a traceback) before the check."""
    src = private_copy(checkpoint("tiny3"))
    rows = (src / "tokenizer.jsonl").read_text().splitlines()
    rows[300] = '["\\ud800x", -5.0, "NORMAL"]'
    (src / "tokenizer.jsonl").write_text("\n".join(rows) + "\n")
    (tmp_path / "out").mkdir()
    out = tmp_path / "out" / "m.gguf"
    assert "row 300" in one_line_error(_export(cli, src, out, expect=2), 2)
    assert _leftovers(out) == []
