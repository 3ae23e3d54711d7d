"""`export mlx` keeps convert's output rules (docs/security.md): one-line refusals with meaningful
exit codes, nothing outside OUT touched, nobody else's file written over, an interrupted export
never looks complete (no config.json, the record says "writing") and is redone by the same
command, a second writer refused while the first holds the lock.  Most of these need no MLX
(--no-verify); the ones that run mlx-lm are marked.

Shown to fail: with `prepare_output` skipped, the foreign-file and planted-link tests went red
(the link's target was overwritten); with the `finally` that removes config.json taken out, the
interrupted-verification test went red; with `recipe.check()` removed, two of the bad-option
tests went red.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from plamo2_tools.export import mlx as export_mlx_module
from plamo2_tools.outputs import RECORD_NAME


def test_a_foreign_file_in_out_is_never_replaced(cli, checkpoint, tmp_path: Path, one_line_error) -> None:  # noqa: ANN001
    out = tmp_path / "mlx"
    out.mkdir()
    (out / "model.safetensors").write_text("mine")
    line = one_line_error(cli("export", "mlx", checkpoint("tiny"), out, "--no-verify", expect=2), 2)
    assert "exists and is not empty" in line
    r = cli("export", "mlx", checkpoint("tiny"), out, "--no-verify", "--force", expect=2)
    assert "model.safetensors" in one_line_error(r, 2)
    assert (out / "model.safetensors").read_text() == "mine"


@pytest.mark.parametrize(
    "planted", ["model.safetensors", "model.safetensors.partial", "config.json", "config.json.tmp", "tokenizer.jsonl"]
)
def test_a_planted_link_is_refused_and_its_target_untouched(
    cli, checkpoint, tmp_path: Path, one_line_error, planted: str
) -> None:  # noqa: ANN001
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "mlx"
    out.mkdir()
    os.symlink(victim, out / planted)
    one_line_error(cli("export", "mlx", checkpoint("tiny"), out, "--no-verify", expect=2), 2)
    assert "did not write it" in one_line_error(
        cli("export", "mlx", checkpoint("tiny"), out, "--no-verify", "--force", expect=2), 2
    )
    assert victim.read_text() == "precious" and (out / planted).is_symlink()


def test_force_over_our_own_output_replaces_a_link_planted_there_never_its_target(
    cli, checkpoint, tmp_path: Path
) -> None:  # noqa: ANN001, E501
    """A link standing where a file of ours was is removed as ours (unlinked, never followed) and a
    fresh file is written in its place."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "mlx"
    cli("export", "mlx", checkpoint("tiny"), out, "--no-verify")
    (out / "model.safetensors").unlink()
    os.symlink(victim, out / "model.safetensors")
    cli("export", "mlx", checkpoint("tiny"), out, "--no-verify", "--force")
    assert victim.read_text() == "precious"
    assert not (out / "model.safetensors").is_symlink() and (out / "model.safetensors").stat().st_size > 1000


def test_force_replaces_only_what_export_wrote(cli, checkpoint, tmp_path: Path) -> None:  # noqa: ANN001
    out = tmp_path / "mlx"
    cli("export", "mlx", checkpoint("tiny"), out, "--no-verify", "--max-part-size", "100kB")
    parts = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(parts) > 1
    (out / "notes.txt").write_text("keep me")
    cli("export", "mlx", checkpoint("tiny"), out, "--no-verify", "--force")  # one file now
    assert (out / "notes.txt").read_text() == "keep me"
    assert not any(out.glob("model-*.safetensors")) and not (out / "model.safetensors.index.json").exists()
    assert json.loads((out / RECORD_NAME).read_text())["status"] == "complete"


def test_an_interrupted_export_does_not_look_complete_and_is_redone(
    cli, checkpoint, tmp_path: Path, interrupt, one_line_error
) -> None:  # noqa: ANN001
    out = tmp_path / "mlx"
    restore = interrupt(export_mlx_module, "write_file", on_call=2)
    r = cli("export", "mlx", checkpoint("tiny"), out, "--no-verify", "--max-part-size", "100kB", "--json", expect=130)
    assert "no config.json" in one_line_error(r, 130, prefix="interrupted:")
    assert not (out / "config.json").exists()
    assert not list(out.glob("*.partial")) and not list(out.glob("*.tmp"))
    assert json.loads((out / RECORD_NAME).read_text())["status"] == "writing"
    restore()
    cli("export", "mlx", checkpoint("tiny"), out, "--no-verify", "--max-part-size", "100kB")  # no --force needed
    assert (out / "config.json").is_file()


@pytest.mark.mlx
def test_an_interrupted_verification_takes_config_json_away(
    cli, checkpoint, tmp_path: Path, interrupt, one_line_error
) -> None:  # noqa: ANN001
    from plamo2_tools.deploy.mlx import MLXTarget
    from plamo2_tools.errors import CheckpointError
    from plamo2_tools.export import verified

    out = tmp_path / "mlx"
    interrupt(verified, "verify_export")
    one_line_error(cli("export", "mlx", checkpoint("tiny"), out, "--json", expect=130), 130, prefix="interrupted:")
    assert not (out / "config.json").exists()
    assert not (out / "plamo2_export.json").exists()
    with pytest.raises(CheckpointError, match="unfinished export mlx"):
        MLXTarget(str(out))


def test_a_second_writer_is_refused(cli, checkpoint, tmp_path: Path, one_line_error) -> None:  # noqa: ANN001
    from plamo2_tools.shards.lock import OutputLock

    out = tmp_path / "mlx"
    out.mkdir()
    with OutputLock(out, "export mlx"):
        line = one_line_error(cli("export", "mlx", checkpoint("tiny"), out, "--no-verify", expect=3), 3)
    assert "export mlx" in line


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--bits", 3), "--bits 3"),
        (("--bits", 4, "--group-size", 48), "--group-size 48"),
        (("--mixed",), "--mixed needs --bits"),
        (("--dtype", "int8"), "--dtype"),
        (("--max-part-size", "lots"), "lots"),
    ],
)
def test_bad_options_are_one_line(cli, checkpoint, tmp_path: Path, one_line_error, args: tuple, says: str) -> None:  # noqa: ANN001
    out = tmp_path / "mlx"
    assert says in one_line_error(cli("export", "mlx", checkpoint("tiny"), out, *args, "--no-verify", expect=2), 2)
    assert not out.exists()


def test_out_inside_the_source_is_refused(cli, checkpoint, private_copy, one_line_error) -> None:  # noqa: ANN001
    src = private_copy(checkpoint("tiny"))
    line = one_line_error(cli("export", "mlx", src, src / "mlx", "--no-verify", expect=2), 2)
    assert "inside the source" in line
    assert not (src / "mlx").exists()


def test_a_side_file_linking_out_of_the_source_is_refused(
    cli, checkpoint, private_copy, tmp_path: Path, one_line_error
) -> None:  # noqa: ANN001
    secret = tmp_path / "secret.txt"
    secret.write_text("do not copy")
    src = private_copy(checkpoint("tiny"))
    os.symlink(secret, src / "notes.txt")
    one_line_error(cli("export", "mlx", src, tmp_path / "mlx", "--no-verify", expect=2), 2)
    assert not (tmp_path / "mlx" / "notes.txt").exists()


def test_shards_as_source_need_a_reference_to_verify(cli, shards, tmp_path: Path, one_line_error) -> None:  # noqa: ANN001
    line = one_line_error(cli("export", "mlx", shards("tiny", 2, 1), tmp_path / "mlx", expect=2), 2)
    assert "--reference" in line


@pytest.mark.mlx
def test_a_reference_of_another_model_is_refused_before_writing(
    cli, checkpoint, shards, tmp_path: Path, one_line_error
) -> None:  # noqa: ANN001
    out = tmp_path / "mlx"
    r = cli("export", "mlx", shards("tiny", 2, 1), out, "--reference", checkpoint("tiny-gqa"), expect=2)
    assert "not shaped like" in one_line_error(r, 2)
    assert not out.exists()


def test_shards_export_what_the_checkpoint_exports(cli, checkpoint, shards, tmp_path: Path) -> None:  # noqa: ANN001
    """A shard directory is read as the checkpoint it came from: the export holds the same tensors,
    byte-identical except the norm weights, whose folded offsets come back within one float32
    rounding (docs/convert.md, merge), quantized exports too."""
    import numpy as np
    from safetensors.numpy import load_file

    for args in ((), ("--bits", 4, "--group-size", 32)):
        a, b = tmp_path / f"hf{len(args)}", tmp_path / f"sh{len(args)}"
        cli("export", "mlx", checkpoint("tiny"), a, "--no-verify", *args)
        cli("export", "mlx", shards("tiny", 2, 2), b, "--no-verify", *args)
        ta, tb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
        assert sorted(ta) == sorted(tb)
        for name in ta:
            if "norm" in name and "proj" not in name:
                np.testing.assert_allclose(tb[name], ta[name], rtol=0, atol=1.2e-7, err_msg=name)
            else:
                assert ta[name].tobytes() == tb[name].tobytes(), name
        assert json.loads((a / "config.json").read_text()) == json.loads((b / "config.json").read_text())


def test_an_unfinished_source_is_refused(cli, checkpoint, private_copy, tmp_path: Path, one_line_error) -> None:  # noqa: ANN001
    src = private_copy(checkpoint("tiny"))
    record = json.loads((src / RECORD_NAME).read_text())
    (src / RECORD_NAME).write_text(json.dumps({**record, "status": "writing"}))
    one_line_error(cli("export", "mlx", src, tmp_path / "mlx", "--no-verify", expect=2), 2)
    assert not (tmp_path / "mlx").exists()


def test_the_kernel_copy_and_its_fallback_write_the_same_bytes(
    cli, checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:  # noqa: ANN001
    """Unquantized tensors of an HF source go through copy_file_range; where the kernel refuses
    (EXDEV here) the same chunks go through user space, byte for byte the same."""
    import errno

    calls = []
    real = os.copy_file_range

    def counting(*args: int) -> int:
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(os, "copy_file_range", counting)
    cli("export", "mlx", checkpoint("tiny3-mqa"), tmp_path / "kernel", "--no-verify")
    assert calls, "no tensor was copied inside the kernel"

    def refused(*args: int) -> int:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "copy_file_range", refused)
    cli("export", "mlx", checkpoint("tiny3-mqa"), tmp_path / "user", "--no-verify")
    kernel, user = (tmp_path / d / "model.safetensors" for d in ("kernel", "user"))
    assert kernel.read_bytes() == user.read_bytes()
