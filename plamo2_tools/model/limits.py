"""What a config's structural integers may be, for every family (issue 28): bounded above, far
beyond any real model, and checked before anything is built from them.  A hostile
`num_hidden_layers: 1e9` built a per-layer tuple before any check (25 s and all memory); a width
past int32 is no model torch or vLLM can index.  Limits are on structure, not on honest scale
(docs/security.md, "Out of scope")."""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError

MAX_LAYERS = 4096  # real checkpoints have tens; every per-layer table is built from this number
MAX_INT = 2**31 - 1  # widths, heads, vocabularies, windows, positions: torch's and vLLM's int32 indexing


def int_problem(name: str, value: int) -> str | None:
    """Why a structural integer of a config is out of range (None: it is fine)."""
    limit = MAX_LAYERS if name == "num_hidden_layers" else MAX_INT
    if value <= 0:
        return "must be a positive integer"
    if value > limit:
        return f"must be at most {limit}"
    return None


def shown_int(value: object) -> object:
    """A value for a message: an integer of more than 12 digits in scientific notation (1e300 read
    from a config is a 301-digit int)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**12:
        return float(f"{value:.4g}")
    return value


def token_ids(value: Any, source: str, name: str, many: bool = False) -> Any:
    """A config's token id (or null; for EOS, `many`, also a list of ids), else one line: a string
    there became its characters wherever the ids were used."""
    if value is None:
        return None
    values = value if many and isinstance(value, list) else [value]
    if any(isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_INT for v in values):
        raise ConfigError(
            f"{source}: {name} = {value!r:.40}: must be a token id (a non-negative integer)"
            + (" or a list of them" if many else "")
        )
    return value
