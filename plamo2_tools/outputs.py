"""What our writers put in a directory, by their own record, so that replacing an output removes
exactly that and never a file of the user's: the rule behind every `--force` (convert, merge,
synth) and every restart of an interrupted run.

convert keeps its record in the shard format (manifest and journal, `shards/owned.py`).  merge and
synth write HF checkpoints, which have no place for one, so they leave `.plamo2_written.json`
beside them: written before their first byte with status "writing" and every file they will
write, marked "complete" at the end.  A reader (`ensure_complete`) refuses a directory whose
writer never finished instead of reporting, say, a missing config.json.

A file of someone else's that stands where a writer must put one of its own is never replaced,
with or without `--force`: the writer refuses with one line naming it.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .errors import CheckpointError, EnvironmentLimitError, OutputExistsError, Plamo2Error, human_bytes
from .jsonio import CONFIG_BYTES, read_json
from .safe_files import mount_point, plain_name
from .safetensors_io import atomic_write_text

RECORD_NAME = ".plamo2_written.json"
SIBLINGS = (".partial", ".tmp")  # the temporary names a file of ours is written under


def read_record(out: Path) -> dict[str, Any] | None:
    """The record of merge or synth in `out`; None when there is none.  Its `files` decide what a
    later run deletes, so each must be a plain name (exit 2 naming the record and the entry)."""
    path = out / RECORD_NAME
    if not path.exists() and not path.is_symlink():
        return None
    try:
        record = read_json(path, CONFIG_BYTES)
    except Plamo2Error:  # unreadable or not JSON: not a record of ours
        return None
    if not isinstance(record, dict):
        return None
    files = record.get("files") or []
    if not isinstance(files, list):
        raise CheckpointError(f"{path}: `files` is not a list: not a record plamo2-tools wrote")
    record["files"] = [plain_name(n, str(path)) for n in files]
    return record


def untrusted_record(e: Plamo2Error, out: Path) -> CheckpointError:
    """A record in OUT (manifest, journal, `.plamo2_written.json`) that names something no writer of
    ours writes, a path out of OUT say: it cannot tell which files are ours, so `--force` keeps
    refusing; the line says how to clear the way (issue 28)."""
    return CheckpointError(
        f"{e}; --force removes only the files a record of plamo2-tools names, and this record cannot be "
        f"trusted: delete {out} yourself if nothing in it is yours to keep, or write into another directory"
    )


def write_record(out: Path, command: str, source: str, files: list[str], status: str) -> None:
    record = {"format": "plamo2-written", "command": command, "status": status, "source": source, "files": files}
    atomic_write_text(out / RECORD_NAME, json.dumps(record) + "\n")


def recorded_outputs(out: Path) -> set[str]:
    record = read_record(out)
    return {str(n) for n in record.get("files") or []} if record else set()


def ensure_complete(directory: Path) -> None:
    """Refuse a directory that merge or synth started and never finished (killed, disk full, ...)."""
    record = read_record(directory)
    if record is not None and record.get("status") != "complete":
        cmd = record.get("command", "plamo2-tools")
        raise CheckpointError(
            f"{directory}: an unfinished {cmd} (from {record.get('source')}): run the same {cmd} again to redo it"
        )


def prepare_output(out: Path, writes: list[str], force: bool) -> None:
    """For merge and synth: an empty OUT, or an unfinished run of ours, goes ahead.  Anything else
    needs --force, which removes the files an earlier run recorded and keeps everyone else's."""
    try:
        record = read_record(out)
    except Plamo2Error as e:
        raise untrusted_record(e, out) from None
    ours = recorded_outputs(out)
    unfinished = record is not None and record.get("status") != "complete"
    # A killed run's temporaries (NAME.partial, NAME.tmp of a recorded NAME) are ours too.
    ours_too = ours | {n + s for n in ours for s in SIBLINGS}
    others = [p.name for p in out.iterdir() if not p.name.startswith(".") and p.name not in ours_too]
    if (others or (record is not None and not unfinished)) and not force:
        raise OutputExistsError(f"{out}: exists and is not empty (use --force to replace what plamo2-tools wrote)")
    remove_outputs(out, ours, first="config.json")
    refuse_foreign(out, writes)


def remove_outputs(out: Path, names: Iterable[str], first: str | None = None) -> None:
    """Delete these files of ours and their temporary siblings; `first` goes first (the file whose
    presence says "complete": the directory must stop looking complete before the rest goes)."""
    names = set(names)
    ordered = ([first] if first in names else []) + sorted(names - {first})
    for name in ordered:
        if not name or "/" in name or name in (".", ".."):  # a record of ours names plain files only
            continue
        for candidate in (name, *(name + s for s in SIBLINGS)):
            path = out / candidate
            if path.is_file() or path.is_symlink():
                path.unlink()


def refuse_foreign(out: Path, planned: Iterable[str]) -> None:
    """Call after removing our own files: whatever still stands where we would write is someone
    else's, and nothing is written over it.  One line naming the files."""
    foreign = [
        c
        for name in sorted(set(planned))
        for c in (name, *(name + s for s in SIBLINGS))
        if (out / c).exists() or (out / c).is_symlink()
    ]
    if foreign:
        it = "it" if len(foreign) == 1 else "them"
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise OutputExistsError(
            f"{out}: {shown} would be overwritten but plamo2-tools did not write {it}; move {it} away "
            "(--force replaces only files of ours)"
        )


def make_output_dir(out: Path) -> None:
    """mkdir -p OUT, with one-line errors: an existing file there (or above it) is the user's to
    fix (exit 2); a refusal from the system (permissions, read-only, full) is environmental (3)."""
    for p in (out, *out.parents):
        if p.exists() and not p.is_dir():
            raise OutputExistsError(f"{out}: {p} exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise EnvironmentLimitError(f"{out}: cannot create the output directory ({e.strerror or e})") from None


def check_free_space(out: Path, need: int, what: str) -> None:
    """Refuse before writing when the output's filesystem has less room than `need` bytes."""
    free = shutil.disk_usage(out).free
    if need > free:
        raise EnvironmentLimitError(
            f"{out}: not enough disk space: {what} needs {human_bytes(need)}, {human_bytes(free)} free "
            f"on the filesystem mounted at {mount_point(out)}"
        )
