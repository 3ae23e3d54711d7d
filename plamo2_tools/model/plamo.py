"""What the PLaMo families share, torch-free (each written once, the families' configs and tables
import it): the derived values every PLaMo config computes alike, the check that a config.json is
the family's, and the offsets of PLaMo's four-norm decoder layer (model/forward.py:PlamoLayer),
which PLaMo 2 and PLaMo 3 fold into their stored norm deltas alike (docs/model.md §3.1)."""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from .layout import padded_vocab

# The four norms of a PLaMo decoder layer, in order, with the offset each stored delta is added to.
NORM_OFFSETS = {
    "pre_mixer_norm": 1.0,
    "post_mixer_norm": 1.0 / 5,
    "pre_mlp_norm": 1.0,
    "post_mlp_norm": 1.0 / 5**1.5,
}
FINAL_NORM_OFFSET = 1.0


class PlamoConfig:
    """The values every PLaMo config derives alike (a base of the families' frozen dataclasses)."""

    vocab_size: int
    eos_token_id: int | list[int] | None

    @property
    def padded_vocab(self) -> int:
        """Vp = ceil(V / 64) * 64, vLLM's VocabParallelEmbedding padding."""
        return padded_vocab(self.vocab_size)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)


def model_type_of(raw: dict[str, Any], model_types: tuple[str, ...], source: str, family: str) -> str:
    """config.json's model_type (the family's first when absent), checked first: another model's
    config would otherwise be reported as missing or malformed keys."""
    model_type = raw.get("model_type", model_types[0])
    if model_type not in model_types:
        raise ConfigError(
            f"{source}: model_type is {model_type!r}, expected {model_types[0]!r} (is this a {family} checkpoint?)"
        )
    return model_type
