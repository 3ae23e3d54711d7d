"""Commands around GGUF files besides `export gguf`: `kld-base` (llama.cpp's KL-divergence base file
from our reference forward, for `llama-perplexity --kl-divergence`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .console import out, print_json
from .options import Json


def kld_base(
    src: Annotated[Path, typer.Argument(help="HF checkpoint directory (the reference).")],
    out_file: Annotated[Path, typer.Argument(metavar="OUT", help="The base file to write.")],
    text: Annotated[Path, typer.Option(help="A UTF-8 text file to tokenize and score (e.g. wiki.test.raw).")],
    ctx: Annotated[int, typer.Option(help="Tokens per chunk: run llama-perplexity with the same -c.")] = 512,
    chunks: Annotated[int | None, typer.Option(help="At most this many chunks (default: all).")] = None,
    add_bos: Annotated[
        bool | None,
        typer.Option(
            "--add-bos/--no-add-bos",
            help="Evaluate every chunk with BOS first, as llama-perplexity does for a GGUF whose add_bos_token is "
            "true (our exports); default: the tokenizer's own rule. A GGUF from llama.cpp's converter needs "
            "--no-add-bos.",
        ),
    ] = None,
    device: Annotated[str, typer.Option(help="Where the reference forward runs.")] = "cpu",
    precision: Annotated[
        str, typer.Option(help="The reference's precision: float64, or float32 where float64 does not fit (8B).")
    ] = "float64",
    force: Annotated[bool, typer.Option(help="Replace an existing KL-divergence base file at OUT.")] = False,
    as_json: Json = False,
) -> None:
    """Write llama.cpp's --kl-divergence-base file from the reference forward of SRC, so that any
    GGUF can be scored against the reference with your own llama.cpp build:
    llama-perplexity -m FILE.gguf --kl-divergence-base OUT --kl-divergence -c CTX."""
    from ..deploy.kld import make_base

    result = make_base(src, out_file, text, ctx, chunks, add_bos, force=force, device=device, precision=precision)
    if as_json:
        print_json(result)
        return
    out.print(
        f"wrote {out_file}: {result['n_chunk']} chunk(s) of {ctx} tokens, {result['scored_per_chunk']} scored "
        f"each, vocabulary {result['n_vocab']}, BOS {'added' if result['add_bos'] else 'not added'}; run "
        f"llama-perplexity -m FILE.gguf --kl-divergence-base {out_file} --kl-divergence -c {ctx}",
        highlight=False,
    )
