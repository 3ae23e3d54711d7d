"""Where one process's wall time went, from its own start (issue 33: the in-process split of a
command run from the shell, beside the shell's wall).

`mark(name)` records the seconds since the process was started (the kernel's start time of this
process, so the interpreter's own start-up and every import before the first mark count); `add(name,
seconds)` sums a phase that happens in pieces (the model's generate calls during an evaluation).
`eval --json` and `generate --json` print `timeline()`; with $PLAMO2_TIMELINE_DIR set, every
command writes it there as it exits (`record_at_exit`: the split of each run of a benchmark that
times commands from outside, e.g. `python -m bench e2e`).  Imports nothing heavy: any module may mark.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time

_lock = threading.Lock()
_marks: dict[str, float] = {}
_sums: dict[str, float] = {}
_IMPORTED = time.monotonic()


def _process_age() -> float:
    """Seconds since this process started: /proc's start time against the uptime clock on Linux,
    else since this module was imported."""
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read().rsplit(b")", 1)[1].split()
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
        return uptime - int(stat[19]) / os.sysconf("SC_CLK_TCK")  # field 22 (starttime), after pid and comm
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED


def mark(name: str) -> None:
    """Record `name` at the process's current age (the first mark of a name wins)."""
    age = _process_age()
    with _lock:
        _marks.setdefault(name, round(age, 3))


def add(name: str, seconds: float) -> None:
    with _lock:
        _sums[name] = _sums.get(name, 0.0) + seconds


ENV = "PLAMO2_TIMELINE_DIR"
_recording: list[str] = []


def record_at_exit(command: str) -> None:
    """With $PLAMO2_TIMELINE_DIR set, write `timeline()` to DIR/COMMAND-PID.json when the process
    exits (once per process; a directory that cannot be written costs nothing but the record)."""
    directory = os.environ.get(ENV)
    if not directory or _recording:
        return
    _recording.append(command)
    atexit.register(_write, directory, command)


def _write(directory: str, command: str) -> None:
    try:
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"{command}-{os.getpid()}.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"command": command, "argv": sys.argv[1:], **timeline()}, f)
    except OSError:
        pass


def timeline() -> dict[str, dict[str, float]]:
    """{"marks": name -> seconds since the process started, "sums": name -> seconds}, and the age now."""
    with _lock:
        return {
            "marks": dict(_marks),
            "sums": {k: round(v, 3) for k, v in _sums.items()},
            "now": round(_process_age(), 3),
        }
