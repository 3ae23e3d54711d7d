"""An interrupted conversion resumes: finished files that verify are kept, the rest is redone,
and the result is byte-identical to an uninterrupted run."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from convert_expect import flip_byte, journaled, kill_convert_half_way

from plamo2_tools.convert import engine
from plamo2_tools.shards.manifest import MANIFEST_NAME

SPLIT = ("--tp", "2", "--pp", "2", "--max-part-size", "1MB")


@pytest.fixture(scope="module")
def reference(cli, medium_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("reference") / "out"
    cli("convert", medium_checkpoint, out, *SPLIT, "--json")
    return out


def _same_output(out: Path, reference: Path) -> None:
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(p.name for p in reference.iterdir())  # no journal, no .partial left
    for name in names:
        assert (out / name).read_bytes() == (reference / name).read_bytes(), name


@pytest.mark.parametrize("tamper", [False, True], ids=["clean", "tampered"])
def test_resume_after_sigkill(cli, medium_checkpoint: Path, reference: Path, tmp_path: Path, tamper: bool) -> None:
    out = tmp_path / "out"
    finished = kill_convert_half_way(medium_checkpoint, out, SPLIT, files=2, timeout=60.0)
    planned = json.loads((reference / MANIFEST_NAME).read_text())["files"]
    present = {p.name for p in out.glob("*.safetensors")}
    assert finished and set(finished) <= present and present < set(planned)  # really half way
    assert list(out.glob("*.partial")), "the kill should leave unfinished files behind"
    if tamper:  # a finished file damaged after the fact (bad sector, stray write, ...)
        flip_byte(out / finished[0], -10)
    result = json.loads(cli("convert", medium_checkpoint, out, *SPLIT, "--json").stdout)
    assert result["status"] == "resumed"
    reused = set(result["files_reused"])
    assert reused and reused <= present
    expected_reused = set(finished[1:]) if tamper else set(finished)
    assert expected_reused <= reused
    if tamper:
        assert finished[0] not in reused
    _same_output(out, reference)


def test_interrupt_in_process_then_resume(
    cli, medium_checkpoint: Path, reference: Path, tmp_path: Path, interrupt
) -> None:
    """Ctrl-C (KeyboardInterrupt) half way: exit 130, no manifest, no .partial; a rerun resumes."""
    restore = interrupt(engine, "_stream_unit", on_call=10)
    out = tmp_path / "out"
    r = cli("convert", medium_checkpoint, out, *SPLIT, expect=130)
    assert "run the same convert again to resume" in r.stderr.splitlines()[-1]
    assert not (out / MANIFEST_NAME).exists() and not list(out.glob("*.partial"))
    kept = journaled(out)
    assert len(kept) >= 2
    restore()
    result = json.loads(cli("convert", medium_checkpoint, out, *SPLIT, "--json").stdout)
    assert result["status"] == "resumed" and set(kept) <= set(result["files_reused"])
    _same_output(out, reference)


def test_unfinished_run_with_other_options_is_discarded(
    cli, medium_checkpoint: Path, tmp_path: Path, interrupt
) -> None:
    restore = interrupt(engine, "_stream_unit", on_call=3)
    out = tmp_path / "out"
    cli("convert", medium_checkpoint, out, *SPLIT, expect=130)
    restore()
    result = json.loads(cli("convert", medium_checkpoint, out, "--tp", 4, "--json").stdout)
    assert result["status"] == "converted" and not result["files_reused"]
    assert sorted(p.name for p in out.glob("model-rank-*")) == [f"model-rank-{r}-part-0.safetensors" for r in range(4)]
    cli("check", out, "--json")
    assert os.path.exists(out / MANIFEST_NAME)
