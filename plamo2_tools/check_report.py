"""What `check OUT --source SRC` found, for every kind of output it compares with its source: our
shards (shards/source_check.py), an MLX or FP8 export (export/check.py), a GGUF file
(export/gguf_check.py).  One report shape, so that `--json` readers and the CLI's one-line verdict
treat them alike: each kind adds its own figures (`extra`) and names its `kind` (kinds.py).

Torch-free, like the GGUF check that uses it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar


@dataclass
class SourceComparison:
    path: Path
    source: Path
    tensors: int = 0  # output tensors compared with what the source re-derives
    problems: list[str] = field(default_factory=list)

    KIND: ClassVar[str]
    SCHEMA_VERSION: ClassVar[int]

    @property
    def ok(self) -> bool:
        return not self.problems

    def extra(self) -> dict[str, Any]:
        """The kind's own fields, placed after `tensors_compared`."""
        return {}

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.KIND,
            "schema_version": self.SCHEMA_VERSION,
            "path": str(self.path),
            "source": str(self.source),
            "ok": self.ok,
            "tensors_compared": self.tensors,
            **self.extra(),
            "first_problem": self.problems[0] if self.problems else None,
            "problems": self.problems,
        }
