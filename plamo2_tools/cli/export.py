"""`plamo2-tools export gguf|mlx|fp8`: write a checkpoint in the format another runtime loads
(library halves in `plamo2_tools/export/`), each verified against the reference when written."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from ..errors import CheckFailed, UserError
from .console import byte_progress, print_json
from .console import out as out_console
from .errors import OneLineErrors, handle_errors
from .options import Force, Json

app = typer.Typer(
    name="export",
    help="Write a PLaMo checkpoint as GGUF (llama.cpp, Ollama, LM Studio), MLX (mlx-lm) or FP8 "
    "(compressed-tensors, for vLLM and SGLang), verified against the reference.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    cls=OneLineErrors,
)


def gguf(
    src: Annotated[Path, typer.Argument(help="HF checkpoint directory (PLaMo 2 or PLaMo 3).")],
    out: Annotated[Path, typer.Argument(metavar="OUT.gguf", help="The GGUF file to write.")],
    type_name: Annotated[
        str,
        typer.Option(
            "--type",
            help="auto (the checkpoint's bf16/f16, as llama.cpp's converter), f32, f16, bf16, q8_0, q4_0; k-quants "
            "and i-quants (q4_k_m, q6_k, ...) through llama-quantize when it is on PATH.",
        ),
    ] = "auto",
    tensor_type: Annotated[
        list[str] | None,
        typer.Option(
            help="PATTERN=TYPE: tensors whose GGUF name matches the regular expression get TYPE (llama-quantize's "
            "option; e.g. ssm_out=f16). Repeatable; the first match wins.",
        ),
    ] = None,
    recipe: Annotated[
        str | None,
        typer.Option(help="A named set of --tensor-type rules of the model (PLaMo 2: ssm-out-f16, PFN's recipe)."),
    ] = None,
    no_verify: Annotated[
        bool, typer.Option("--no-verify", help="Skip running the file with llama.cpp against the reference.")
    ] = False,
    verify_prompts: Annotated[int, typer.Option(help="Prompts of the verification (seeded random tokens).")] = 4,
    verify_tokens: Annotated[int, typer.Option(help="Tokens per verification prompt.")] = 48,
    device: Annotated[str, typer.Option(help="Where the reference forward of the verification runs.")] = "cpu",
    force: Force = False,
    as_json: Json = False,
) -> None:
    """Write SRC as the GGUF file llama.cpp loads: tensors, transforms and keys as llama.cpp's own
    convert_hf_to_gguf.py writes them, plus the keys it loses that llama.cpp reads.

    Then runs the file with llama.cpp (llama-cpp-python) against the reference forward and records
    KL, top-1 agreement and the first divergent position in OUT.gguf.plamo2-export.json; exit 1 (the
    file kept) when llama.cpp diverges from the reference.
    """
    from ..export.gguf import export_gguf, side_file

    if verify_prompts < 1 or verify_tokens < 2:
        raise UserError("--verify-prompts must be >= 1 and --verify-tokens >= 2")
    with byte_progress(f"export gguf {out.name}", enabled=not as_json) as progress:
        result = export_gguf(src, out, type_name, tensor_type or [], recipe, force=force, verify=not no_verify,
                             verify_prompts=verify_prompts, verify_tokens=verify_tokens, device=device,
                             progress=progress, on_plan=progress.start)  # fmt: skip
    if as_json:
        print_json(result.summary())
    else:
        _print_gguf(result, out, side_file(out))
    if result.diverged():
        from ..export.gguf_verify import describe

        raise CheckFailed(f"{out}: written, but {describe(result.verify)}")


def _print_gguf(result: Any, out: Path, side: Path) -> None:
    out_console.print(f"wrote {out} ({result.type}, {result.tensors} tensors, {result.bytes / 1e6:.1f} MB) in "
                      f"{result.seconds:.1f} s; record: {side}", highlight=False)  # fmt: skip
    for note in result.notes:
        out_console.print(f"note: {note}", highlight=False)
    if result.verify is not None:
        from ..export.gguf_verify import describe

        out_console.print(describe(result.verify), highlight=False)
        for finding in result.verify["runtime"]["lint"]:
            out_console.print(f"llama.cpp: {finding['effect']}", highlight=False)


def mlx() -> None:
    """An MLX directory for mlx-lm (not written yet)."""
    raise UserError("export mlx: not available yet")


def fp8() -> None:
    """A compressed-tensors FP8 checkpoint for vLLM and SGLang (not written yet)."""
    raise UserError("export fp8: not available yet")


for _name, _fn in (("gguf", gguf), ("mlx", mlx), ("fp8", fp8)):
    app.command(_name)(handle_errors(_fn))
