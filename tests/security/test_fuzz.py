"""Issues 21 (class 7) and 28: the short fuzz campaign (tests/security/fuzzing.py says what it does; the
long one is bench/fuzz.py).  Each target gets a bounded number of generated inputs, so the whole
campaign stays near a minute on a 2-core machine."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from fuzzing import TARGETS, Bases, make_bases, run_target
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

EXAMPLES = {
    "safetensors-header": 100,
    "manifest": 100,
    "config": 80,
    "tokenizer-rows": 50,
    "journal": 80,
    "result-file": 100,
    "cli-options": 150,
    "plamo3-config": 40,
    "tokenizer-pieces": 60,
    "batch-file": 25,
}


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> Bases:
    return make_bases(tmp_path_factory.mktemp("fuzz-bases"))


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_fuzz(bases: Bases, target: str) -> None:
    @settings(
        max_examples=EXAMPLES[target],
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.data())
    def one(data: st.DataObject) -> None:
        scratch = Path(tempfile.mkdtemp(prefix="plamo2-fuzz-"))
        try:
            broke = run_target(target, data.draw, bases, scratch)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        assert broke is None, broke[:3000]

    one()


def test_the_contract_can_fail() -> None:
    """The verdict itself: a bug exit, a traceback, two error lines or a stray line all break it."""
    from fuzzing import verdict

    assert verdict(0, "", "") is None and verdict(2, "", "error: x\n") is None
    assert verdict(70, "", "bug: y") == "exit 70"
    assert verdict(2, "", "Traceback (most recent call last):\nerror: x") == "a traceback"
    assert verdict(3, "", "error: a\nerror: b\n") is not None
    assert verdict(2, "", "WARNING skipped\nerror: x\n") is not None
    # a batch file's refused lines: `warning:` lines before the one error line, only where allowed
    assert verdict(2, "", "warning: line 1\nerror: x\n", warnings=True) is None
    assert verdict(2, "", "warning: line 1\nerror: x\n") is not None
    assert verdict(2, "", "warning: line 1\n", warnings=True) is not None
