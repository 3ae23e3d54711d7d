"""The formatter is adopted, not fought (issue 29 item 7): `ruff format` owns the layout of every
Python file, so no line opts out with `# fmt: skip` (837 did before).  `# fmt: off` stays only
around tables whose columns carry meaning (the families' tensor tables, the toy family's copy of
one), each block closed again.  Seen failing with one `# fmt: skip` put back in bench/common.py."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLES = {
    "plamo2_tools/model/plamo2/tensors.py",
    "plamo2_tools/model/plamo3/tensors.py",
    "tests/model/test_family_seam.py",
}
SKIP = re.compile(r"#\s*fmt:\s*skip")
OFF, ON = re.compile(r"^\s*#\s*fmt:\s*off\s*$"), re.compile(r"^\s*#\s*fmt:\s*on\s*$")


def python_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [f for f in out.splitlines() if (ROOT / f).is_file() and f != "tests/test_style.py"]  # it names them


def opt_outs(name: str, text: str) -> list[str]:
    """Where a file opts out of the formatter other than the allowed tables, and unclosed blocks."""
    found, open_at = [], None
    for i, line in enumerate(text.splitlines(), 1):
        if SKIP.search(line) and "SKIP = re.compile" not in line:
            found.append(f"{name}:{i}: # fmt: skip")
        if OFF.match(line):
            if name not in TABLES:
                found.append(f"{name}:{i}: # fmt: off outside the tables")
            open_at = i
        elif ON.match(line):
            open_at = None
    if open_at is not None:
        found.append(f"{name}:{open_at}: # fmt: off never closed")
    return found


def test_no_line_opts_out_of_the_formatter() -> None:
    found = [x for f in python_files() for x in opt_outs(f, (ROOT / f).read_text(encoding="utf-8"))]
    assert not found, "\n".join(found[:20])


def test_the_rule_sees_each_kind_of_opt_out() -> None:
    assert opt_outs("a.py", "x = 1  # fmt: skip\n") == ["a.py:1: # fmt: skip"]
    assert opt_outs("a.py", "# fmt: off\nx = 1\n# fmt: on\n") == ["a.py:1: # fmt: off outside the tables"]
    assert opt_outs(sorted(TABLES)[0], "# fmt: off\nx = 1\n") == [f"{sorted(TABLES)[0]}:1: # fmt: off never closed"]
    assert opt_outs(sorted(TABLES)[0], "# fmt: off\nx = 1\n# fmt: on\n") == []
