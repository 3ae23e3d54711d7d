"""`plamo2-tools export gguf|mlx|fp8`: write a checkpoint in the format another runtime loads
(library halves in `plamo2_tools/export/`), each verified against the reference when written."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..errors import UserError
from .console import byte_progress, out, print_json
from .errors import OneLineErrors, handle_errors
from .options import Force, Json, MaxPartSize

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


def fp8(
    src: Annotated[Path, typer.Argument(help="HF checkpoint directory, or a shard directory made by this tool.")],
    out_dir: Annotated[Path, typer.Argument(metavar="OUT", help="Output directory (an HF checkpoint).")],
    max_part_size: MaxPartSize = "5GiB",
    force: Force = False,
    verify: Annotated[
        bool,
        typer.Option(
            "--verify/--no-verify",
            help="Read the export back, dequantize it and run the reference forward on it and on SRC; the "
            "measured KL and top-1 agreement go to OUT/plamo2_export.json.",
        ),
    ] = True,
    verify_sequences: Annotated[int, typer.Option(help="Fixed random token sequences verified.")] = 4,
    verify_tokens: Annotated[int, typer.Option(help="Tokens per verified sequence.")] = 32,
    verify_dtype: Annotated[
        str, typer.Option(help="Precision of both reference forwards: float64, or float32 for large models.")
    ] = "float64",
    max_kl: Annotated[
        float | None,
        typer.Option(help="Exit 1 (after writing) when the measured mean KL (w8a8) is above this."),
    ] = None,
    workers: Annotated[int, typer.Option(help="Threads quantizing and writing tensors.")] = 2,
    as_json: Json = False,
) -> None:
    """A compressed-tensors FP8 checkpoint (llm-compressor's FP8_DYNAMIC: e4m3 weights with one scale per
    output channel, activations quantized per token at run time) for vLLM and SGLang.

    The family's linears are quantized (PLaMo 3: qkv, o, gate_up, down; PLaMo 2 also the Mamba in_proj,
    its bcdt/dt/out projections stay unquantized); norms, embedding and head keep the source dtype.
    """
    from ..convert.plan import parse_size
    from ..export.fp8 import export_fp8

    if verify_dtype not in ("float64", "float32"):
        raise UserError(f"--verify-dtype {verify_dtype!r}: choose float64 or float32")
    if verify_sequences < 1 or verify_tokens < 1 or workers < 1:
        raise UserError("--verify-sequences, --verify-tokens and --workers must be at least 1")
    if max_kl is not None and not max_kl >= 0:
        raise UserError(f"--max-kl {max_kl}: must be a number >= 0")
    options = {"sequences": verify_sequences, "tokens": verify_tokens, "dtype": verify_dtype}
    with byte_progress(f"export fp8 {src}", enabled=not as_json) as progress:
        result = export_fp8(
            src, out_dir, max_part_size=parse_size(max_part_size), force=force, verify=verify,
            verify_options=options, max_kl=max_kl, workers=workers, progress=progress, on_plan=progress.start,
        )  # fmt: skip
    if as_json:
        print_json(result.record)
        return
    v = result.verification
    checked = (
        f"; verified on {v['variants']['w8a8']['positions']} positions: mean KL {v['kl_mean']:.3g} (weights only "
        f"{v['variants']['weights']['kl_mean']:.3g}), top-1 agreement {v['top1_agreement']:.1%}"
        if v
        else "; not verified (--no-verify)"
    )
    out.print(
        f"exported {src} to {out_dir} as FP8: {result.quantized} linears quantized, {len(result.files)} file(s), "
        f"{result.output_bytes / 1e9:.3f} GB (source {result.source_bytes / 1e9:.3f} GB) in {result.seconds:.2f} s"
        + checked,
        highlight=False,
    )


for _name, _fn in (("gguf", gguf), ("mlx", mlx), ("fp8", fp8)):
    app.command(_name)(handle_errors(_fn))
