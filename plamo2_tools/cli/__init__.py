"""The `plamo2-tools` command line: a thin Typer layer over the library API.

One module per command family (`checkpoints`, `shards`, `run`, `serve`, `evaluate`, `reports`), the shared
options (`options`), the checks of their values (`validators`), where output goes (`console`) and
the one error path (`errors`): every command prints one readable line (no traceback) for user
errors and exits with the codes listed in `plamo2_tools.errors`; `--json` prints machine-readable
results on stdout only.  The commands are registered below, in the order `--help` lists them.
"""

from __future__ import annotations

import logging
from typing import Annotated

import typer
from rich.logging import RichHandler

from ..version import __version__
from . import checkpoints, evaluate, export, gguf, reports, run, serve, shards, warmup
from .console import err, out
from .errors import OneLineErrors, handle_errors

app = typer.Typer(
    name="plamo2-tools",
    help="Split, check, run, serve, export and evaluate PLaMo checkpoints: PLaMo 2 (hybrid Mamba2 + attention) and "
    "PLaMo 3 (attention with sliding windows).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    cls=OneLineErrors,
)


def _print_version(value: bool) -> None:
    if value:
        out.print(__version__, highlight=False)
        raise typer.Exit(0)


@app.callback()
def main(
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log what happens step by step.")] = False,
    version: Annotated[
        bool, typer.Option("--version", help="Print the version and exit.", callback=_print_version, is_eager=True)
    ] = False,
) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(message)s",
        handlers=[RichHandler(console=err, show_path=False)],
    )


COMMANDS = (
    ("synth", checkpoints.synth),
    ("inspect", checkpoints.inspect),
    ("logits", run.logits),
    ("convert", shards.convert),
    ("merge", shards.merge),
    ("check", shards.check),
    ("demo", run.demo),
    ("verify", run.verify),
    ("kld-base", gguf.kld_base),
    ("generate", run.generate),
    ("warmup", warmup.warmup),
    ("serve", serve.serve),
    ("eval", evaluate.eval_shards),
    ("gsm8k-task", evaluate.gsm8k_task),
    ("report", reports.report),
    ("tokenize", checkpoints.tokenize),
)
for _name, _fn in COMMANDS:
    app.command(_name)(handle_errors(_fn))
app.add_typer(export.app, name="export")
app.command(
    "lm-eval", context_settings={"allow_extra_args": True, "ignore_unknown_options": True}, add_help_option=False
)(handle_errors(evaluate.lm_eval_passthrough))

__all__ = ["app"]
