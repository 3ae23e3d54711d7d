"""Errors that reach the user as one readable line and a meaningful exit code.

Exit codes used by every command:
  0  success
  1  a check ran and found a problem (verify mismatch, `check` failure)
  2  bad input or usage (config, tensors, split, existing output, ...)
  3  the environment refused (disk full, permissions, ...)
  130 interrupted (Ctrl-C)
"""

from __future__ import annotations


class Plamo2Error(Exception):
    """Base class: anything the CLI prints as one line instead of a traceback."""

    exit_code = 2


class UserError(Plamo2Error):
    """The input or the request is wrong; fixing it is up to the user."""

    exit_code = 2


class ConfigError(UserError):
    """config.json is missing a key, has an impossible value, or is not a PLaMo 2 config."""


class CheckpointError(UserError):
    """A checkpoint file is unreadable, corrupt, truncated or has the wrong tensors."""


class LayoutError(UserError):
    """The requested TP/PP split cannot be made for this model."""


class OutputExistsError(UserError):
    """The output directory holds something we must not overwrite without --force."""


class EnvironmentLimitError(Plamo2Error):
    """The machine said no: not enough disk, permission denied, ..."""

    exit_code = 3


class CheckFailed(Plamo2Error):
    """A verification ran to the end and found a difference."""

    exit_code = 1
