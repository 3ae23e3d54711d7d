"""Commands about one checkpoint or shard directory as a whole: `synth`, `inspect`, `tokenize`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from .console import byte_progress, out, print_json
from .options import PRESET_HELP, Force, Json, TrustRemoteCode


def synth(
    out_dir: Annotated[Path, typer.Argument(metavar="OUT", help="Directory to create.")],
    preset: Annotated[str, typer.Option(help=f"{PRESET_HELP}.")] = "tiny",
    seed: Annotated[int, typer.Option(help="Random seed; the same seed gives the same bytes.")] = 0,
    dtype: Annotated[str | None, typer.Option(help="float32, bfloat16 or float16 (default: the preset's).")] = None,
    files: Annotated[int, typer.Option(help="Split the weights into N files with an HF index.")] = 1,
    force: Force = False,
    as_json: Json = False,
) -> None:
    """Write a random checkpoint in the exact Hugging Face layout.

    Real shapes for benchmarks, tiny presets for tests (--preset lists them).  Values keep the
    model numerically healthy, and a tokenizer in PLaMo's own format is included.
    """
    from ..model import num_parameters
    from ..model.synth import DTYPES, checkpoint_bytes, preset_config
    from ..model.synth import synth as run

    cfg = preset_config(preset, dtype)
    total = checkpoint_bytes(cfg, DTYPES[cfg.torch_dtype])
    with byte_progress(f"synth {preset}", total, enabled=not as_json) as progress:
        run(out_dir, preset, seed=seed, dtype=dtype, files=files, force=force, progress=progress)
    params = num_parameters(cfg)
    result = {
        "path": str(out_dir),
        "preset": preset,
        "parameters": params,
        "bytes": total,
        "dtype": cfg.torch_dtype,
        "seed": seed,
        "files": files,
    }
    if as_json:
        print_json(result)
    else:
        out.print(f"wrote {preset} ({params:,} parameters, {total / 1e9:.3f} GB {cfg.torch_dtype}) to {out_dir}")


def inspect(
    path: Annotated[Path, typer.Argument(help="An HF checkpoint or a shard directory.")],
    as_json: Json = False,
) -> None:
    """Show the config, the layer map, parameter counts, inventory problems and which TP / PP splits
    are possible (with the reason for each impossible one)."""
    from ..inspect import inspect_path
    from ..model import family_named

    info = inspect_path(path)
    if as_json:
        print_json(info)
        return
    family = family_named(info["family"])
    out.print(f"[bold]{info['path']}[/] ({'HF checkpoint' if info['format'] == 'hf' else 'plamo2-tools shards'})")
    out.print(info["geometry"], highlight=False)
    names = getattr(family, "kind_names", {})
    kinds = dict.fromkeys(x["kind"] for x in info["layers"])
    legend = ", ".join(f"{k[0].upper()} = {names.get(k, k)}" for k in kinds)
    out.print("layers: " + " ".join(x["kind"][0].upper() for x in info["layers"]) + f"  ({legend})")
    for x in info["layers"]:
        if "window" in x:
            window = "full causal" if x["window"] is None else f"window {x['window']}"
            rope = f"RoPE base {x['rope_base']:g}" + (f", {x['rope_scaling']}" if x.get("rope_scaling") else "")
            out.print(f"  layer {x['index']}: {x['kind']}, {window}, {rope}", highlight=False)
    if info["format"] == "hf":
        out.print(f"parameters: {info['parameters']:,} in {info['tensors']} tensors")
    else:
        m = info["mapping"]
        out.print(f"shards: tp={m['tp_size']} pp={m['pp_size']} stages={m['stages']} dtype={info['options']['dtype']}")
        for line in info.get("vllm", []):
            out.print(f"vLLM: {line}", highlight=False)
    out.print("bytes: " + ", ".join(f"{k} {v / 1e9:.3f} GB" for k, v in info["bytes_by_dtype"].items()))
    problems = info.get("inventory_problems") or []
    if problems:
        out.print(f"[red]inventory problems ({len(problems)}):[/]")
        for p in problems:
            out.print(f"  {p}", highlight=False)
    elif info["format"] == "hf":
        out.print("inventory: [green]all tensors present with the expected shapes[/]")
    table = Table(title="possible splits")
    table.add_column("split")
    table.add_column("ok")
    table.add_column("detail")
    for row in info["splits"]["tp"]:
        table.add_row(f"tp={row['tp']}", "yes" if row["ok"] else "[red]no[/]", "; ".join(row["reasons"] + row["notes"]))
    for row in info["splits"]["pp"]:
        detail = "; ".join(row["reasons"]) or "layers per stage " + ",".join(map(str, row["layers"]))
        table.add_row(f"pp={row['pp']}", "yes" if row["ok"] else "[red]no[/]", detail)
    out.print(table)


def tokenize(
    path: Annotated[Path, typer.Argument(help="A checkpoint or shard directory.")],
    input_file: Annotated[
        Path | None, typer.Option("--input", help="Read this file instead of stdin: one JSON string per line.")
    ] = None,
    out_file: Annotated[Path | None, typer.Option("--out", help="Write this file instead of stdout.")] = None,
    decode: Annotated[bool, typer.Option("--decode", help="The reverse: JSON id arrays in, JSON strings out.")] = False,
    skip_special_tokens: Annotated[bool, typer.Option(help="With --decode: leave BOS/EOS/pad/unk out.")] = False,
    trust_remote_code: TrustRemoteCode = False,
) -> None:
    """Token ids of texts with the directory's tokenizer: one JSON string per input line, one JSON
    array of ids per output line (tokenizer(text)["input_ids"], so BOS as add_bos_token says).

    A directory with PLaMo's tokenizer.jsonl is read natively (no remote code, no numba); remote
    code runs only with --trust-remote-code.  Blank lines are skipped.  Exit 2 on bad input.
    """
    from ..model.registry import tokenizer_flavour
    from ..tokenizer.cli_io import run_tokenize

    run_tokenize(path, input_file, out_file, decode, skip_special_tokens, trust_remote_code, tokenizer_flavour(path))
