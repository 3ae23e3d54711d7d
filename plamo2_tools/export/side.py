"""The record an `export mlx` or `export fp8` leaves in its output directory (`plamo2_export.json`:
what was exported, how, and how it verified) and what it says the directory is.  Apart from the
writers so that `check` and `verify` recognise an export without importing them (numpy, the
source readers): `check` on a directory that is no export stays a byte-moving command's start-up."""

from __future__ import annotations

from pathlib import Path

from ..jsonio import CONFIG_BYTES, read_object
from ..kinds import EXPORT_FP8_KIND, EXPORT_MLX_KIND

SIDE_JSON = "plamo2_export.json"
FORMATS = {EXPORT_MLX_KIND: "mlx", EXPORT_FP8_KIND: "fp8"}


def export_format(path: Path) -> str | None:
    """ "mlx" or "fp8" when `path` is a directory one of our exports wrote (its side JSON says which), else None."""
    side = path / SIDE_JSON
    if not path.is_dir() or not side.is_file():
        return None
    kind = read_object(side, CONFIG_BYTES, "an export record").get("kind")
    return FORMATS.get(kind) if isinstance(kind, str) else None
