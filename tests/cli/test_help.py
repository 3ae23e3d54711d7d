"""Every `--help` screen explains instead of confusing (issue 29 item 8): no `--help <bool>`, no
`{shards}` in a usage line, no `<list[Path]>`, no description broken mid-sentence, no "see the
table" without one; `eval --tasks` says only gsm8k runs, `synth --help` lists every preset from the
families' tables, and the top-level help and pyproject's description name PLaMo 2 and PLaMo 3.

The screens come from the real CLI in a fresh interpreter (Typer's CliRunner over `cli.app`, the
console 2000 columns wide so that any line break left in a description is ours, not Rich's
wrapping), which also shows that no help screen imports torch.  Each rule is shown failing on the
screens as they were before this change (the excerpts below) and on a Typer app without our help
polish, which is how the rules were seen red."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import typer
from typer.testing import CliRunner

from plamo2_tools.cli.errors import OneLineErrors
from plamo2_tools.cli.helptext import plain_help, unwrap

ROOT = Path(__file__).resolve().parents[2]
SCREENS = """
import json, sys
from typer.testing import CliRunner
from plamo2_tools.cli import COMMANDS, app
from plamo2_tools.cli.export import app as export_app
names = [[], *([n] for n, _ in COMMANDS), ["export"], *(["export", c.name] for c in export_app.registered_commands)]
screens = {}
for name in names:
    r = CliRunner().invoke(app, [*name, "--help"], terminal_width=2000)
    screens[" ".join(name)] = [r.exit_code, r.output]
print(json.dumps({"screens": screens, "torch": "torch" in sys.modules}))
"""


@pytest.fixture(scope="module")
def screens() -> dict[str, str]:
    env = {"COLUMNS": "2000", "TERMINAL_WIDTH": "2000", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", SCREENS], capture_output=True, text=True, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout)
    assert not got["torch"], "a --help screen imported torch"
    for name, (code, text) in got["screens"].items():
        assert code == 0 and "Usage:" in text, (name, text[-1000:])
    return {name: text for name, (code, text) in got["screens"].items()}


def _description(line: str) -> str:
    """A help line without Rich's box characters."""
    return line.strip().strip("│").strip()


def defects(screen: str) -> list[str]:
    """What is wrong with one help screen (rendered wide enough that Rich wraps nothing)."""
    found = []
    for line in screen.splitlines():
        if re.search(r"<bool>", line):
            found.append(f"a type beside a flag: {line.strip()}")
        if re.search(r"<\w*\[", line):
            found.append(f"a Python type as metavar: {line.strip()}")
        if line.strip().startswith("Usage:") and re.search(r"\{\w+\}", line):
            found.append(f"an argument in braces: {line.strip()}")
        if re.search(r"(?i)see the table", line) and "┃" not in screen:
            found.append(f"'see the table' with no table: {line.strip()}")
    lines = screen.splitlines()
    for before, line in zip(lines, lines[1:], strict=False):
        text, prev = _description(line), _description(before)
        in_panel = line.lstrip().startswith("│")
        # A description continued on the next line: in a panel, a row whose name columns are empty;
        # in the prose, a line right after another.  Wide as the screen is, only a break in the
        # source puts it there.
        continued = (in_panel and re.match(r"│\s{12,}", line.strip())) or (not in_panel and prev)
        if continued and re.match(r"[a-z(]", text) and not text.startswith("plamo2-tools "):
            found.append(f"broken mid-sentence: {prev[-40:]!r} / {text[:40]!r}")
    return found


def test_no_help_screen_has_a_defect(screens: dict[str, str]) -> None:
    assert len(screens) >= 19  # the top level, 15 commands, export and its three
    problems = {name or "(top)": defects(text) for name, text in screens.items()}
    assert not {k: v for k, v in problems.items() if v}


def test_arguments_are_named_as_the_readme_names_them(screens: dict[str, str]) -> None:
    usage = {name: next(ln.strip() for ln in text.splitlines() if "Usage:" in ln) for name, text in screens.items()}
    assert usage["convert"].endswith("[OPTIONS] SRC OUT")
    assert usage["check"].endswith("[OPTIONS] PATH") and usage["eval"].endswith("[OPTIONS] SHARDS")
    assert usage["verify"].endswith("[OPTIONS] TARGET...") and usage["report"].endswith("[OPTIONS] INPUT...")


def test_synth_lists_every_preset_from_the_families(screens: dict[str, str]) -> None:
    from plamo2_tools.model.registry import all_presets

    assert len(all_presets()) >= 13
    missing = [
        name for name in all_presets() if not re.search(rf"(?<![\w.-]){re.escape(name)}(?![\w-])", screens["synth"])
    ]
    assert not missing


def test_eval_says_what_runs(screens: dict[str, str]) -> None:
    tasks = next(ln for ln in screens["eval"].splitlines() if "--tasks" in ln)
    assert "gsm8k" in tasks and "Comma-separated" not in tasks


def test_the_top_level_and_the_package_name_both_families(screens: dict[str, str]) -> None:
    description = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["description"]
    for text in (screens[""].split("Options")[0], description):
        assert "PLaMo 2" in text and "PLaMo 3" in text, text


def test_help_text_keeps_brackets_and_lines_meant_as_lines(screens: dict[str, str]) -> None:
    assert 'tokenizer(text)["input_ids"]' in screens["tokenize"]  # Rich markup would eat ["input_ids"]
    assert "plamo2-tools lm-eval run --model plamo --model_args pretrained=SHARDS" in screens["gsm8k-task"]


# The rules on screens as they were before (excerpts of the real output at 200 columns).
BEFORE = {
    "bool": "│ --help                                  <bool>  Show this message and exit.      │",
    "braces": " Usage: plamo2-tools convert [OPTIONS] {src} {OUT}",
    "list": "│ *    INPUT...      <list[Path]>  Result files or directories (recursive). [required]  │",
    "prose": " Copies in the kernel where bytes are verbatim, on all cores, with bounded memory; records an\n"
    " XXH3-128 digest of every file and tensor; writes the manifest plamo2_shards.json last, and\n"
    " resumes an interrupted run.",
    "panel": "│ inspect     Show the config, the layer map, parameter counts, inventory problems and which TP / PP  │\n"
    "│             splits are possible (with the reason for each impossible one).                          │",
    "table": " Choose a backend (see the table).",
}


@pytest.mark.parametrize("kind", sorted(BEFORE))
def test_each_rule_fails_on_the_old_screens(kind: str) -> None:
    assert defects(BEFORE[kind]), kind


def _planted_app(cls: type | None) -> typer.Typer:
    app = typer.Typer(add_completion=False, **({"cls": cls} if cls else {}))

    @app.command()
    def copy(
        src: Path,
        paths: list[Path],
        force: bool = typer.Option(False, "--force", help="Replace what we wrote\n    before."),
    ) -> None:
        """Copy SRC, the files
        listed, into the place named [here].

        A second paragraph whose lines
        were wrapped by hand.
        """

    @app.command()
    def other() -> None:
        """A second command, so that the first keeps its name."""

    return app


def test_the_polish_removes_what_the_rules_find() -> None:
    """A Typer app as Typer renders it has the defects; the same app under our group has none."""
    plain = CliRunner().invoke(_planted_app(None), ["copy", "--help"], terminal_width=2000).output
    polished = CliRunner().invoke(_planted_app(OneLineErrors), ["copy", "--help"], terminal_width=2000).output
    assert len(defects(plain)) >= 4, plain
    assert not defects(polished), polished
    assert "Usage: root copy [OPTIONS] SRC PATHS..." in polished and "[here]" in polished


def test_unwrap_keeps_paragraphs_and_marked_lines() -> None:
    assert unwrap("One\n    two.\n\n    Three\n    four.") == "One two.\n\nThree four."
    assert unwrap("Intro.\n\n\b\nplamo2-tools a \\\n  --b") == "Intro.\n\nplamo2-tools a \\\n  --b"
    assert plain_help("pip install 'plamo2-tools[mlx]'") == "pip install 'plamo2-tools\\[mlx]'"
