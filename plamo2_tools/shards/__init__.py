"""The shard format's home (docs/shard-format.md): naming, metadata, the manifest's writer and
reader (`load_manifest`, a typed `Manifest` view), and `check`.  Convert writes through it; the
runtime, eval, inspect and the CLI read through it."""

from .manifest import JOURNAL_NAME, MANIFEST_NAME, Manifest, TensorEntry, load_manifest

__all__ = ["JOURNAL_NAME", "MANIFEST_NAME", "Manifest", "TensorEntry", "load_manifest"]
