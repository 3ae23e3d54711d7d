"""What the tests of issue 21 share (docs/security.md): the real CLI in a subprocess, bounded in
time (a hang is a failure, not a stuck suite), and a sibling directory `outside` with files a
hostile input points at, compared byte for byte before and after each test.

Every test that plants a link or a name checks three things: the exit code, exactly one line on
stderr and no traceback (`one_line_error`), and that nothing outside its working directory
changed (`outside`'s snapshot, taken again at teardown).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from cli_env import ROOT, cli_env  # noqa: F401 - ROOT for tests that need the checkout

SECRET = b"private bytes that no plamo2-tools command may change\n"


Run = Callable[..., subprocess.CompletedProcess]


def memory_limit(limit: int | None) -> Callable[[], None] | None:
    """A preexec function capping the child's address space at `limit` bytes (`ulimit -v`): an
    input that makes memory grow fails there instead of taking the machine's.  One thread for
    torch's pools (each thread's arena counts towards the cap: the same headroom on any core count)."""
    if limit is None:
        return None

    def cap() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return cap


@pytest.fixture(scope="session")
def run() -> Run:
    """run(*ARGS, timeout=120, input=None, memory=None): `python -m plamo2_tools.cli ARGS` as a
    user runs it; `memory` caps its address space in bytes (`ulimit -v`)."""

    def call(
        *args: str | int | Path, timeout: float = 120, input: str | None = None, memory: int | None = None
    ) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "plamo2_tools.cli", *map(str, args)]
        env = cli_env() if memory is None else {**cli_env(), "OMP_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "2"}
        return subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            input=input,
            cwd=ROOT,
            preexec_fn=memory_limit(memory),
        )

    return call


def snapshot(root: Path) -> dict[str, tuple[str, bytes | str]]:
    """Every entry under `root`: its kind and bytes (files) or target (links), without following."""
    found: dict[str, tuple[str, bytes | str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                found[rel] = ("link", os.readlink(p))
            elif p.is_file():
                found[rel] = ("file", p.read_bytes())
            else:
                found[rel] = ("other", "")
    return found


class Outside:
    """A directory beside the test's working directory, holding `secret` (a private file) and
    `model.safetensors` (a file hostile names point at)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir()
        self.secret = path / "secret.txt"
        self.secret.write_bytes(SECRET)
        self.before = snapshot(path)

    def retake(self) -> None:
        """After the test itself put a file outside (the target of a hostile name)."""
        self.before = snapshot(self.path)

    def unchanged(self) -> None:
        assert snapshot(self.path) == self.before, "a file outside the working directory changed"
        assert self.secret.read_bytes() == SECRET


@pytest.fixture
def outside(tmp_path: Path) -> Iterator[Outside]:
    o = Outside(tmp_path / "outside")
    yield o
    o.unchanged()  # checked again after the test, whatever the test itself asserted


@pytest.fixture
def work(tmp_path: Path) -> Path:
    w = tmp_path / "work"
    w.mkdir()
    return w


@pytest.fixture(scope="session")
def tiny_shards(run, checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`tiny` (with its tokenizer) converted at tp 2 by the CLI under test: read-only, copy before
    damaging."""
    out = tmp_path_factory.mktemp("sec-shards") / "shards"
    r = run("convert", checkpoint("tiny"), out, "--tp", 2, "--json")
    assert r.returncode == 0, r.stderr
    return out
