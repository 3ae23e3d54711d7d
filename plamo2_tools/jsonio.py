"""Every JSON we read from a file goes through here: bounded in size and depth, never a hang on a
FIFO, never a traceback (docs/security.md, "Hostile structure").

Python's `json` decodes nested arrays by recursion, so a few thousand `[` reach a RecursionError
(a bug exit) before any type check could run; a size limit per kind of file keeps a hostile
`config.json` from filling memory.  The callers still check the types of what they use: this
module only promises that what comes back is a bounded tree of JSON values.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import CheckpointError
from .safe_files import read_regular

MAX_DEPTH = 64  # our deepest file (a manifest's pieces) is 5 levels; lm-eval's results about 8
KiB, MiB = 1 << 10, 1 << 20
# Limits per kind of file (bytes): far above anything real, far below what hurts.
CONFIG_BYTES = 16 * MiB  # config.json, generation_config.json, tokenizer_config.json, index
MANIFEST_BYTES = 512 * MiB  # a 100B-parameter model at tp 8 has a manifest of a few MB
RESULT_BYTES = 256 * MiB  # report's inputs (lm-eval samples can be large)


def parse_json(data: bytes | str, where: str, max_depth: int = MAX_DEPTH) -> Any:
    """The value of a JSON text, or one CheckpointError line naming `where`."""
    try:
        value = json.loads(data)
    except RecursionError:
        raise CheckpointError(f"{where}: JSON nested too deeply (more than {max_depth} levels)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{where}: not valid JSON ({e})") from None
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        raise CheckpointError(f"{where}: not valid JSON ({e})") from None
    if depth(value) > max_depth:
        raise CheckpointError(f"{where}: JSON nested too deeply (more than {max_depth} levels)")
    return value


def read_json(path: Path, limit: int = CONFIG_BYTES, where: str | None = None) -> Any:
    """A JSON file's value: a regular file (a FIFO or a directory refused at once), at most `limit`
    bytes, at most MAX_DEPTH deep."""
    return parse_json(read_regular(path, limit), where or str(path))


def read_object(path: Path, limit: int = CONFIG_BYTES, what: str = "a JSON object") -> dict[str, Any]:
    """read_json for files whose top level must be an object (configs, manifests, records)."""
    value = read_json(path, limit)
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: not {what} (the top level is a JSON {type_name(value)})")
    return value


def depth(value: Any) -> int:
    """Nesting depth of a decoded JSON value (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            v = list(v.values())
        if isinstance(v, list):
            deepest = max(deepest, d + 1)
            stack += [(x, d + 1) for x in v if isinstance(x, (dict, list))]
    return deepest


def type_name(value: Any) -> str:
    """JSON's name for a decoded value's type, for messages ("expected an object, got a list")."""
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)
