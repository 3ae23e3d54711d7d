"""Errors that reach the user as one readable line and a meaningful exit code.

Exit codes used by every command:
  0  success
  1  a check ran and found a problem (verify mismatch, `check` failure)
  2  bad input or usage (config, tensors, split, existing output, ...)
  3  the environment refused (disk full, permissions, no GPU, another run writing the output, ...)
  70 a bug in plamo2-tools: the only case that prints a traceback (the CLI says so and where to
     report it); 70 is sysexits' EX_SOFTWARE, kept apart from 1, which means "a check found a difference"
  130 interrupted (Ctrl-C, SIGTERM)
"""

from __future__ import annotations

import errno

BUG_EXIT_CODE = 70
# Where the crash line sends people; one place to change when the tracker moves.
REPORT_BUGS_TO = "the plamo2-tools issue tracker (with the command line, `plamo2-tools --version` and the traceback)"


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


class OutputBusyError(EnvironmentLimitError):
    """Another process holds the output lock of a directory (shards/lock.py): a second writer, or
    a reader of a directory that is still being written."""


class CheckFailed(Plamo2Error):
    """A verification ran to the end and found a difference."""

    exit_code = 1


# OS errors that are the machine's refusal, not a fault of the input: exit 3 wherever they surface.
ENVIRONMENT_ERRNOS = frozenset(
    {
        errno.EACCES,
        errno.EPERM,
        errno.EROFS,
        errno.ENOSPC,
        errno.EDQUOT,
        errno.EIO,
        errno.EMFILE,
        errno.ENFILE,
        errno.ENOMEM,
        errno.EBUSY,
        errno.ETXTBSY,
    }
)


def os_error(e: OSError, what: str) -> Plamo2Error:
    """The one rule from an OSError to the user's line and exit code: the machine's refusals
    (permissions, read-only, full, I/O, limits) exit 3; everything else about a path the user gave
    (missing, not a file, a directory, a name too long, ...) exits 2.  `what` names the path and
    what was being done ("x.safetensors: cannot read")."""
    reason = "no space left on device" if e.errno == errno.ENOSPC else (e.strerror or str(e))
    cls = EnvironmentLimitError if e.errno in ENVIRONMENT_ERRNOS else UserError
    return cls(f"{what} ({reason})")


def human_bytes(n: float) -> str:
    """1234 -> '1.23 kB', 5.2e9 -> '5.20 GB': sizes in messages stay readable (and never round a
    small but real size to '0.00 GB')."""
    units = ("B", "kB", "MB", "GB", "TB")
    i = 0
    while abs(n) >= 1000 and i < len(units) - 1:
        n, i = n / 1000, i + 1
    return f"{n:.0f} B" if i == 0 else f"{n:.2f} {units[i]}"
