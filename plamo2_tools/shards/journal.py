"""The journal of an unfinished conversion (docs/shard-format.md, "Writing, the journal and resume"):
`.plamo2_convert.journal.jsonl` in the output directory, append-only.  Its first line holds the
plan's fingerprint and every file the run may write (`writes`), so that a later run or `--force`
removes exactly those; each later line records one finished file with its size and digests.  A
line cut short by a kill is ignored.  The one reader and writer: convert, resume, `--force`,
`inspect` and every "unfinished conversion" message go through here.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, os_error
from ..jsonio import MANIFEST_BYTES, parse_json
from ..safe_files import open_regular, plain_name, read_regular
from ..safetensors_io import atomic_write_text

JOURNAL_NAME = ".plamo2_convert.journal.jsonl"


@dataclass(frozen=True)
class JournalState:
    fingerprint: str | None
    writes: tuple[str, ...]  # every file the run may create
    finished: dict[str, dict[str, Any]]  # file -> {file, size, digest, tensors}


class Journal:
    def __init__(self, directory: Path) -> None:
        self.path = directory / JOURNAL_NAME
        self.lock = threading.Lock()

    def exists(self) -> bool:
        return self.path.exists()

    def state(self) -> JournalState | None:
        """What the journal says, or None when there is none (or it has no readable first line).
        Every file name in it must be a plain name (exit 2 naming the journal and the entry): the
        journal decides what a later run deletes."""
        if not self.path.exists() and not self.path.is_symlink():
            return None
        # Never through a symlink, never blocking on a FIFO, bounded in size.
        lines = read_regular(self.path, MANIFEST_BYTES, follow=False).splitlines()
        rows = []
        for line in lines:
            try:
                row = parse_json(line, str(self.path))
            except CheckpointError:  # a line cut short by a kill
                continue
            if isinstance(row, dict):
                rows.append(row)
        if not rows:
            return None
        head, records = rows[0], rows[1:]
        where = str(self.path)
        writes = head.get("writes") if isinstance(head.get("writes"), list) else []
        fingerprint = head.get("fingerprint") if isinstance(head.get("fingerprint"), str) else None
        finished = {plain_name(r["file"], where): r for r in records if "file" in r}
        return JournalState(fingerprint, tuple(plain_name(w, where) for w in writes), finished)

    def finished(self, fingerprint: str) -> dict[str, dict[str, Any]] | None:
        """Finished-file records if the journal belongs to this plan, else None."""
        state = self.state()
        if state is None or state.fingerprint != fingerprint:
            return None
        return state.finished

    def start(self, fingerprint: str, writes: list[str]) -> None:
        """`writes`: every file this run may create, so that a later run (or --force) removes
        exactly those and nothing of the user's (shards/owned.py)."""
        atomic_write_text(self.path, json.dumps({"fingerprint": fingerprint, "writes": writes}) + "\n")

    def append(self, record: dict[str, Any]) -> None:
        try:
            with self.lock:
                fd = open_regular(self.path, os.O_WRONLY | os.O_APPEND, follow=False)
                try:
                    os.write(fd, (json.dumps(record) + "\n").encode())
                    os.fsync(fd)
                finally:
                    os.close(fd)
        except OSError as e:  # a full disk here too is the environment's refusal, not a crash
            raise os_error(e, f"{self.path}: cannot record a finished file") from None

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
