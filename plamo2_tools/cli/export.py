"""`plamo2-tools export gguf|mlx|fp8`: write a checkpoint in the format another runtime loads
(library halves in `plamo2_tools/export/`), each verified against the reference when written."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from ..errors import CheckFailed, UserError
from .console import byte_progress, out, print_json
from .console import out as out_console
from .errors import OneLineErrors, handle_errors
from .options import Force, Json, MaxPartSize
from .validators import require

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
        result = export_gguf(
            src,
            out,
            type_name,
            tensor_type or [],
            recipe,
            force=force,
            verify=not no_verify,
            verify_prompts=verify_prompts,
            verify_tokens=verify_tokens,
            device=device,
            progress=progress,
            on_plan=progress.start,
        )
    if as_json:
        print_json(result.summary())
    else:
        _print_gguf(result, out, side_file(out))
    if result.diverged():
        from ..export.gguf_verify import describe

        raise CheckFailed(f"{out}: written, but {describe(result.verify)}")


def _print_gguf(result: Any, out: Path, side: Path) -> None:
    out_console.print(
        f"wrote {out} ({result.type}, {result.tensors} tensors, {result.bytes / 1e6:.1f} MB) in "
        f"{result.seconds:.1f} s; record: {side}",
        highlight=False,
    )
    for note in result.notes:
        out_console.print(f"note: {note}", highlight=False)
    if result.verify is not None:
        from ..export.gguf_verify import describe

        out_console.print(describe(result.verify), highlight=False)
        for finding in result.verify["runtime"]["lint"]:
            out_console.print(f"llama.cpp: {finding['effect']}", highlight=False)


def mlx(
    src: Annotated[Path, typer.Argument(metavar="SRC", help="An HF checkpoint, or a shard directory of ours.")],
    out_dir: Annotated[Path, typer.Argument(metavar="OUT", help="The MLX model directory to write.")],
    bits: Annotated[
        int | None, typer.Option(help="Quantize with MLX's affine scheme at 4 or 8 bits (default: no quantization).")
    ] = None,
    group_size: Annotated[int, typer.Option(help="Values per scale and bias (32, 64 or 128).")] = 64,
    mixed: Annotated[
        bool,
        typer.Option(
            "--mixed",
            help="PFN's mixed precision: the MLPs at --bits, the rest at 8 bits, PLaMo 2's bcdt_proj, dt_proj and "
            "out_proj (ssm_out) unquantized.",
        ),
    ] = False,
    dtype: Annotated[
        str | None, typer.Option(help="Cast the weights to float32, bfloat16 or float16 (default: as the source).")
    ] = None,
    reference: Annotated[
        Path | None,
        typer.Option(help="The HF checkpoint to verify against (default: SRC; needed when SRC is a shard directory)."),
    ] = None,
    no_verify: Annotated[
        bool, typer.Option("--no-verify", help="Skip running the export with mlx-lm against the reference.")
    ] = False,
    max_part_size: MaxPartSize = "5GiB",
    force: Force = False,
    as_json: Json = False,
) -> None:
    """An MLX directory for mlx-lm (`mlx_lm.load`), verified against the reference forward.

    Weights named and shaped as mlx-lm's PLaMo 2 / PLaMo 3 model expects, quantized (--bits) bit for
    bit as mlx.core.quantize does, config with `quantization`, tokenizer files copied; then mlx-lm
    runs it on a fixed prompt set and the KL, top-1 agreement and first divergence against the
    float64 reference go into OUT/plamo2_export.json.  Exit 1 when mlx-lm's output diverges (the
    directory is kept: the divergence is mlx-lm's, named in the figures)."""
    from ..convert.plan import parse_size
    from ..dtypes import float_dtype
    from ..export.mlx import Recipe, export_mlx_path

    if bits is not None and bits not in (4, 8):
        raise UserError(f"--bits {bits}: choose 4 or 8")
    recipe = Recipe(bits=bits, group_size=group_size, mixed=mixed, dtype=float_dtype(dtype) if dtype else None)
    record = export_mlx_path(
        src,
        out_dir,
        recipe,
        verify=not no_verify,
        reference=reference,
        force=force,
        max_part=parse_size(max_part_size),
        progress_for=lambda total: byte_progress(f"export mlx {src}", total, enabled=not as_json),
    )
    verification = record.get("verification")
    if as_json:
        print_json(record)
    else:
        dtypes = record["dtype"] if isinstance(record["dtype"], list) else [record["dtype"]]
        what = f"{bits}-bit{' mixed' if mixed else ''}" if bits else ",".join(dtypes)
        size = f"{record['bytes'] / 1e9:.3f} GB, {record['bits_per_weight']:.2f} bits/weight"
        out.print(
            f"exported {src} to {out_dir} for mlx-lm ({what}, {size}) in {record['seconds']:.2f} s", highlight=False
        )
        for d in record["known_differences"]:
            out.print(f"  mlx-lm differs: {d['text']}", highlight=False)
        if verification:
            out.print(f"  verified with mlx-lm: {verification['summary']}", highlight=False)
    if verification and not verification["passed"]:
        raise CheckFailed(f"{out_dir}: mlx-lm's output differs from the reference: {verification['summary']}")


def fp8(
    src: Annotated[Path, typer.Argument(help="HF checkpoint directory, or a shard directory made by this tool.")],
    out_dir: Annotated[Path, typer.Argument(metavar="OUT", help="Output directory (an HF checkpoint).")],
    max_part_size: MaxPartSize = "5GiB",
    force: Force = False,
    verify: Annotated[
        bool,
        typer.Option(
            "--verify/--no-verify",
            help="Judge the export as `verify OUT --reference SRC` does (the fp8 target: the export read back and "
            "run as W8A8); the result goes to OUT/plamo2_export.json.",
        ),
    ] = True,
    reference: Annotated[
        Path | None,
        typer.Option(help="The HF checkpoint to verify against (default: SRC; needed when SRC is a shard directory)."),
    ] = None,
    verify_sequences: Annotated[int, typer.Option(help="Prompts of the export prompt set verified.")] = 4,
    verify_tokens: Annotated[int, typer.Option(help="The longest prompt, in tokens (12 to this).")] = 40,
    verify_dtype: Annotated[
        str, typer.Option(help="Precision of both forwards (reference and FP8): float64, or float32 for large models.")
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
    if verify:
        require("torch")  # the reference forward; refused before the export, not after it
    options = {
        "count": verify_sequences,
        "lengths": (min(12, verify_tokens), verify_tokens),
        "precision": verify_dtype,
        "dtype": verify_dtype,
    }
    with byte_progress(f"export fp8 {src}", enabled=not as_json) as progress:
        result = export_fp8(
            src,
            out_dir,
            max_part_size=parse_size(max_part_size),
            force=force,
            verify=verify,
            reference=reference,
            verify_options=options,
            max_kl=max_kl,
            workers=workers,
            progress=progress,
            on_plan=progress.start,
        )
    v = result.verification
    if as_json:
        print_json(result.record)
    else:
        out.print(
            f"exported {src} to {out_dir} as FP8: {result.quantized} linears quantized, {len(result.files)} file(s), "
            f"{result.output_bytes / 1e9:.3f} GB (source {result.source_bytes / 1e9:.3f} GB) in {result.seconds:.2f} s",
            highlight=False,
        )
        out.print(f"  verified: {v['summary']}" if v else "  not verified (--no-verify)", highlight=False)
    if v and not v["passed"]:
        raise CheckFailed(f"{out_dir}: the FP8 export diverges from the reference: {v['summary']}")


for _name, _fn in (("gguf", gguf), ("mlx", mlx), ("fp8", fp8)):
    app.command(_name)(handle_errors(_fn))
