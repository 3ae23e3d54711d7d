"""`pip install plamo2-tools` moves bytes without PyTorch; the extras add the rest (issue 29 item 8).

Three checks: the table by which a command names its missing extra (`cli/errors.py` EXTRAS) against
pyproject.toml's extras; the choice of extra per command; and, slow, the real thing: a fresh venv
with only the base dependencies converts and checks a synthetic checkpoint and refuses a command
that needs `[run]` in one line.  (tests/cli/test_no_torch.py runs every byte-moving command on the
base install's packages alone, fast.)  Seen failing: with "lm_eval" moved from [eval] to [report]
in EXTRAS (the table tests), and with `check --source` in the venv, which needs torch (the
one-line refusal of test_no_torch's `logits` was seen failing with the `ModuleNotFoundError` branch
taken out of handle_errors: a bug report, exit 70)."""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

from plamo2_tools.cli.errors import COMMAND_EXTRA, EXTRAS, missing_extra

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
NOT_COMMAND_EXTRAS = {"dev", "all"}  # the tests' and everything: no command asks for these


def _name(text: str) -> str:
    return re.sub(r"[-_.]+", "-", text).lower()


def extra_names(extra: str) -> set[str]:
    """The distributions an extra names, its references to our other extras followed."""
    names: set[str] = set()
    for spec in PROJECT["optional-dependencies"][extra]:
        req = Requirement(spec)
        if _name(req.name) == "plamo2-tools":
            for inner in req.extras:
                names |= extra_names(inner)
        else:
            names.add(_name(req.name))
    return names


def distribution_of(module: str) -> set[str]:
    """Who provides a top-level module here; its own name where it is not installed (mlx)."""
    return {_name(d) for d in importlib.metadata.packages_distributions().get(module, [module])}


def test_every_module_of_an_extra_comes_with_that_extra() -> None:
    declared = set(PROJECT["optional-dependencies"]) - NOT_COMMAND_EXTRAS
    assert set(EXTRAS) == declared, "an extra in pyproject.toml without its modules in cli/errors.py EXTRAS"
    wrong = {
        (extra, module)
        for extra, modules in EXTRAS.items()
        for module in modules
        if not distribution_of(module) & extra_names(extra)
    }
    assert not wrong, f"modules that their extra does not install: {wrong}"
    assert set(EXTRAS) - {"all"} <= {
        e for spec in PROJECT["optional-dependencies"]["all"] for e in Requirement(spec).extras
    }


def test_nothing_an_extra_provides_is_in_the_base() -> None:
    base = {_name(Requirement(spec).name) for spec in PROJECT["dependencies"]}
    for heavy in ("torch", "triton", "lm-eval", "matplotlib", "fastapi", "uvicorn"):
        assert heavy not in base
    dev = extra_names("dev")
    assert {"torch", "lm-eval", "fastapi", "matplotlib"} <= dev  # README's test command installs .[dev]


@pytest.mark.parametrize(
    ("command", "module", "extra"),
    [
        ("eval_shards", "torch", "eval"),  # eval's own extra brings torch with it
        ("eval_shards", "lm_eval", "eval"),
        ("serve", "torch", "serve"),
        ("serve", "uvicorn.config", "serve"),
        ("generate", "torch", "run"),
        ("fp8", "torch", "run"),
        ("report", "matplotlib", "report"),
        ("mlx", "mlx", "mlx"),
        ("convert", "xxhash", None),  # a base dependency missing: a broken install, reported as a bug
        ("report", None, None),
    ],
)
def test_the_extra_a_command_asks_for(command: str, module: str | None, extra: str | None) -> None:
    assert missing_extra(command, module) == extra


def test_each_command_extra_exists() -> None:
    assert set(COMMAND_EXTRA.values()) <= set(EXTRAS)


def _pip(venv: Path, *args: str) -> None:
    r = subprocess.run([venv / "bin" / "python", "-m", "pip", "install", "-q", *args], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.slow
def test_the_base_install_converts_and_checks_and_names_a_missing_extra(checkpoint, tmp_path: Path) -> None:
    """A fresh venv, our package without dependencies, then exactly pyproject's base dependencies
    from the package index (about 90 s with a warm pip cache)."""
    source = tmp_path / "source"  # a copy: pip builds in place and would leave build/ in the checkout
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "plamo2_tools", source / "plamo2_tools", ignore=shutil.ignore_patterns("__pycache__"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    _pip(venv, "--no-deps", str(source))
    _pip(venv, *PROJECT["dependencies"])
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    cli = venv / "bin" / "plamo2-tools"

    def run(*args: object, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [cli, *map(str, args)], capture_output=True, text=True, env=env, input=stdin, cwd=tmp_path
        )

    installed = subprocess.run([venv / "bin" / "python", "-m", "pip", "list"], capture_output=True, text=True).stdout
    assert not re.search(r"(?im)^(torch|triton|lm[-_]eval|matplotlib|fastapi|uvicorn) ", installed), installed
    src = checkpoint("tiny3")
    converted = run("convert", src, tmp_path / "shards", "--tp", 2, "--json")
    assert converted.returncode == 0, converted.stderr[-2000:]
    checked = run("check", tmp_path / "shards")
    assert checked.returncode == 0 and "ok:" in checked.stdout, checked.stderr[-2000:]
    merged = run("merge", tmp_path / "shards", tmp_path / "merged")
    assert merged.returncode == 0, merged.stderr[-2000:]
    tokens = run("tokenize", src, stdin='"hello"\n')
    assert tokens.returncode == 0 and tokens.stderr == "", tokens.stderr  # no stray "PyTorch was not found"
    refused = run("generate", tmp_path / "shards", "--prompt", "hi")
    assert refused.returncode == 3 and refused.stdout == "", refused.stderr
    assert refused.stderr.splitlines() == [
        "error: plamo2-tools generate needs torch, which is not installed: pip install 'plamo2-tools[run]'"
    ]
