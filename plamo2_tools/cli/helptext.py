"""`--help` that reads as written (issue 29 item 8), applied to every command before Click runs.

Typer renders our docstrings and option help as Rich markup with the docstring's own line breaks,
shows a type column (`<bool>`) beside flags and `--help`, `<list[str]>` beside repeatable values,
and arguments as `{src}` in the usage line.  `polish` walks the command tree once and fixes each:
paragraphs are re-joined into one line each (Rich wraps them to the terminal) except those that
begin with `\\b` (kept line by line: commands to copy), help is escaped so `[mlx]` stays visible,
flags have no type, a repeatable value shows its element type, and arguments are `SRC OUT`
(optional ones `[OUT]`) as Click writes them.  tests/cli/test_help.py walks every screen.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

from rich.markup import escape

NO_REWRAP = "\b"


def unwrap(text: str | None) -> str | None:
    """Each paragraph on one line, except those marked `\\b` (whose marker is dropped)."""
    if not text:
        return text
    paragraphs = re.split(r"\n\s*\n", inspect.cleandoc(text).strip())
    joined = []
    for paragraph in paragraphs:
        if paragraph.startswith(NO_REWRAP):
            joined.append(paragraph.removeprefix(NO_REWRAP).strip("\n"))
        else:
            joined.append(" ".join(paragraph.split()))
    return "\n\n".join(joined)


def plain_help(text: str | None) -> str | None:
    """Unwrapped and escaped for Rich (our help is text, not markup)."""
    unwrapped = unwrap(text)
    return escape(unwrapped) if unwrapped else unwrapped


def _plain_type(param: Any, original: Any) -> Any:
    def display_type_rich(ctx: Any) -> str | None:
        shown = original(ctx)
        if shown is None:
            return None
        return re.sub(r"<list\[(\w+)\]>", lambda m: f"<{m.group(1).lower()}>", str(shown))

    return display_type_rich


def _argument_usage(param: Any) -> Any:
    def get_usage_pieces(ctx: Any) -> list[str]:
        dots = "..." if param.nargs != 1 and not param.metavar.endswith("...") else ""
        name = param.metavar + dots
        return [name if param.required else f"[{name}]"]

    return get_usage_pieces


def _plain_help_option(command: Any) -> None:
    original = command.get_help_option

    def get_help_option(ctx: Any) -> Any:
        option = original(ctx)
        if option is not None:
            option.metavar = ""
        return option

    command.get_help_option = get_help_option


def polish(command: Any) -> None:
    """Fix `command`'s help screens and those of every command under it (module docstring).
    Idempotent: a second call (Typer builds the tree once per process) changes nothing."""
    if getattr(command, "_plamo_polished", False):
        return
    command._plamo_polished = True
    command.help = plain_help(command.help)
    if command.short_help:
        command.short_help = plain_help(command.short_help)
    _plain_help_option(command)
    for param in getattr(command, "params", []):
        param.help = plain_help(getattr(param, "help", None))
        if getattr(param, "param_type_name", "") == "argument":
            if param.metavar is None:
                param.metavar = param.name.upper()
            param.get_usage_pieces = _argument_usage(param)
            param.display_type_rich = lambda ctx: None  # the name (SHARDS, SRC) says what it is
        elif getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""  # a flag takes no value: no `<bool>`
        else:
            param.display_type_rich = _plain_type(param, param.display_type_rich)
    for sub in getattr(command, "commands", {}).values():
        polish(sub)
