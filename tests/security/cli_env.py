"""The environment the security tests run `plamo2-tools` in (a module, not the conftest, so
that tests can import it by name: tests/security is on their path)."""

from __future__ import annotations

import os
from pathlib import Path

# PLAMO2_CLI_ROOT runs the subprocess CLI from another checkout: how these tests were seen to
# fail on main's code (docs/security.md, "Tests").  Commands run with ROOT as their working
# directory, since `python -m` puts the working directory first on the path.
ROOT = Path(os.environ.get("PLAMO2_CLI_ROOT") or Path(__file__).resolve().parents[2])


def cli_env() -> dict[str, str]:
    env = dict(os.environ, COLUMNS="250", NO_COLOR="1", PYTHONPATH=str(ROOT), TRITON_INTERPRET="1")
    env.pop("PLAMO2_GSM8K_DIR", None)
    return env
