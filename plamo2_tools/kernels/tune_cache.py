"""Tuning decisions kept between runs, so that warm-up is paid once per machine, not per process.

A kernel that measures which of its variants is fastest for a shape (kernels/ssd.py `auto_choice`)
records the choice here; the next process reads it back instead of measuring again.  The cache is
a plain JSON file users can see and delete: `$PLAMO2_CACHE_DIR/kernels/<name>.json`, else
`~/.cache/plamo2-tools/kernels/<name>.json` (`PLAMO2_TUNE_CACHE=0` turns it off).

A cache is only ever a hint: it is ignored (and rewritten at the next decision) when it is not
valid JSON, when its header does not name exactly this software and device (format version,
plamo2-tools, torch and Triton versions, device name and capability: a decision measured elsewhere
may be wrong here), and entry by entry when a value is not one of the choices the caller allows.
Writes are atomic (a temporary file renamed into place), so a crash leaves the old file or the new.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

log = logging.getLogger("plamo2_tools.kernels")
FORMAT_VERSION = 1
MAX_BYTES = 1 << 20  # a tuning cache is a few kB; anything bigger is not ours


def cache_dir() -> Path | None:
    if os.environ.get("PLAMO2_TUNE_CACHE", "1") == "0":
        return None
    root = os.environ.get("PLAMO2_CACHE_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "plamo2-tools"
    return base / "kernels"


class TuneCache:
    """Decisions of one kernel, keyed by a string, valid for one `identity` (software + device)."""

    def __init__(self, name: str, identity: dict[str, str], path: Path | None = None) -> None:
        directory = cache_dir()
        self.path = path or (directory / f"{name}.json" if directory else None)
        self.identity = {"format_version": str(FORMAT_VERSION), **identity}
        self.entries: dict[str, Any] = {}
        self.lock = threading.Lock()
        self._loaded = False

    def _load(self) -> None:
        self._loaded = True
        if self.path is None:
            return
        try:
            if self.path.stat().st_size > MAX_BYTES:
                raise ValueError("too large")
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as e:  # corrupt or unreadable: measured again, then rewritten
            log.info("%s: ignoring the tuning cache (%s)", self.path, e)
            return
        if (
            not isinstance(data, dict)
            or data.get("identity") != self.identity
            or not isinstance(data.get("entries"), dict)
        ):
            log.info("%s: ignoring a tuning cache made by other software or another device", self.path)
            return
        self.entries = dict(data["entries"])

    def get(self, key: str, valid: Callable[[Any], bool]) -> Any | None:
        """The recorded decision for `key`, or None when there is none or it is not `valid`."""
        with self.lock:
            if not self._loaded:
                self._load()
            value = self.entries.get(key)
        if value is None:
            return None
        try:
            ok = valid(value)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            log.info("%s: ignoring the invalid entry %s = %r", self.path, key, value)
            return None
        return value

    def put(self, key: str, value: Any) -> None:
        """Record a decision and write the file (best effort: a cache that cannot be written costs
        only the next process's warm-up)."""
        with self.lock:
            if not self._loaded:
                self._load()
            self.entries[key] = value
            if self.path is None:
                return
            data = {"identity": self.identity, "entries": self.entries}
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
                os.replace(tmp, self.path)
            except OSError as e:
                log.info("%s: cannot write the tuning cache (%s)", self.path, e)
                with contextlib.suppress(OSError):
                    tmp.unlink(missing_ok=True)


def key_of(parts: Iterable[object]) -> str:
    return "|".join(str(p) for p in parts)
