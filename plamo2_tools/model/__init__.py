"""The model's home (docs/model.md): PLaMo 2's configuration and variants, its tensor table, the
HF checkpoint reader/writer, the reference forward and synthetic checkpoints.  Everything else in
the package builds on this; nothing here imports the converter, the shard format or the runtime."""

from .config import Plamo2Config

__all__ = ["Plamo2Config"]
