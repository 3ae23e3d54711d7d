"""`plamo2-tools export gguf|mlx|fp8`: write a checkpoint in the format another runtime loads
(library halves in `plamo2_tools/export/`), each verified against the reference when written."""

from __future__ import annotations

import typer

from ..errors import UserError
from .errors import OneLineErrors, handle_errors

app = typer.Typer(
    name="export",
    help="Write a PLaMo checkpoint as GGUF (llama.cpp, Ollama, LM Studio), MLX (mlx-lm) or FP8 "
    "(compressed-tensors, for vLLM and SGLang), verified against the reference.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    cls=OneLineErrors,
)


def gguf() -> None:
    """GGUF for llama.cpp (not written yet)."""
    raise UserError("export gguf: not available yet")


def mlx() -> None:
    """An MLX directory for mlx-lm (not written yet)."""
    raise UserError("export mlx: not available yet")


def fp8() -> None:
    """A compressed-tensors FP8 checkpoint for vLLM and SGLang (not written yet)."""
    raise UserError("export fp8: not available yet")


for _name, _fn in (("gguf", gguf), ("mlx", mlx), ("fp8", fp8)):
    app.command(_name)(handle_errors(_fn))
