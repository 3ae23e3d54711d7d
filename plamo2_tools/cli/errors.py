"""The one error path of every command (plamo2_tools.errors has the exit codes).

User and environment errors are one `error:` line with exit 2 or 3; Ctrl-C or SIGTERM says what
is left behind (130); anything else is a bug: its traceback, then one line saying so and where to
report it (70).  Click's usage errors are one line with exit 2 too (`OneLineErrors`).
"""

from __future__ import annotations

import functools
import importlib
import re
import signal
import sys
import traceback
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import typer
from rich.markup import escape
from typer.core import TyperGroup

from .. import timeline
from ..errors import BUG_EXIT_CODE, ENVIRONMENT_ERRNOS, REPORT_BUGS_TO, Plamo2Error
from ..version import __version__
from .console import err
from .helptext import polish

# Typer's own click (a vendored copy in recent Typer, the click package in older ones): its
# exception classes are the ones raised.
clicks = importlib.import_module(typer.BadParameter.__module__)
NoArgsIsHelpError = getattr(clicks, "NoArgsIsHelpError", ())  # click < 8.2 prints help without raising
F = TypeVar("F", bound=Callable[..., Any])

# What an interrupted command leaves behind, per command (the function's name); `{out}` is its
# output directory.  Commands not listed write nothing before they finish.
INTERRUPTED = {
    "convert": "{out} keeps the finished shard files and has no manifest yet; run the same convert again to resume",
    "merge": "{out} is incomplete (no config.json yet); run the same merge again to redo it",
    "fp8": "{out} is incomplete (no config.json yet); run the same export fp8 again to redo it",
    "synth": "{out} is incomplete; run the same synth again to redo it",
    "demo": "{out} may hold unfinished layouts; run demo again to redo them",
    "report": "the report may be incomplete; run report again",
    "lm_eval_passthrough": "lm-eval's outputs may be incomplete",
    "generate": "{out} holds the results finished so far; run the same command again to resume",
    "mlx": "{out} is incomplete (no config.json); run the same export again to redo it",
}


# What each optional extra of pyproject.toml provides, by the top-level module a command imports
# (tests/test_extras.py checks this against pyproject's extras), and which extra a command asks for
# when one of its modules is missing: `eval` asks for [eval], which brings torch with it.
EXTRAS = {
    "run": ("torch", "triton"),
    "serve": ("torch", "triton", "fastapi", "uvicorn", "pydantic", "jinja2"),
    "eval": ("torch", "triton", "lm_eval", "yaml", "tqdm"),
    "report": ("matplotlib",),
    "mlx": ("mlx", "mlx_lm"),
    "gguf": ("gguf", "llama_cpp"),
}
COMMAND_EXTRA = {"serve": "serve", "eval_shards": "eval", "gsm8k_task": "eval", "lm_eval_passthrough": "eval"}


def missing_extra(command: str, module: str | None) -> str | None:
    """The extra that provides `module` for `command` (None when no extra does: then a missing
    module is a broken install, not a choice, and stays a bug report)."""
    top = (module or "").partition(".")[0]
    wanted = COMMAND_EXTRA.get(command)
    if wanted is not None and top in EXTRAS[wanted]:
        return wanted
    return next((extra for extra, modules in EXTRAS.items() if top in modules), None)


def command_name(command: str) -> str:
    """The CLI name of a command function (`eval_shards` is `eval`, `fp8` is `export fp8`)."""
    if command in ("gguf", "mlx", "fp8"):
        return f"export {command}"
    return command.removesuffix("_shards").removesuffix("_passthrough").replace("_", "-")


def one_line(message: str) -> str:
    """A message as one line: the line breaks a library put in its own text (transformers' and
    remote code's errors span several lines) become ` | `, so a refusal is always one line."""
    return " | ".join(part.strip() for part in message.strip().splitlines() if part.strip())


def error_line(message: str, label: str = "error") -> None:
    """One line on stderr, never wrapped, never read as Rich markup (messages hold [brackets])."""
    err.print(f"[bold red]{label}:[/] {escape(one_line(message))}", highlight=False, soft_wrap=True)


class OneLineErrors(TyperGroup):
    """Click's usage errors (unknown option, bad value, missing argument) as one `error:` line with
    exit 2, like every other bad input, instead of a usage box; help and --version unchanged."""

    def main(
        self,
        args: Any = None,
        prog_name: Any = None,
        complete_var: Any = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        _forward_option_help(self, sys.argv[1:] if args is None else list(args))
        polish(self)

        def run() -> Any:
            return super(OneLineErrors, self).main(
                args=args, prog_name=prog_name, complete_var=complete_var, standalone_mode=False, **extra
            )

        if not standalone_mode:
            return run()
        try:
            code = run()
        except NoArgsIsHelpError as e:  # the help text is printed already
            sys.exit(e.exit_code)
        except clicks.ClickException as e:
            ctx = getattr(e, "ctx", None)
            where = f"{ctx.command_path}: " if ctx is not None else ""
            hint = f" (see {ctx.command_path} --help)" if ctx is not None and isinstance(e, clicks.UsageError) else ""
            error_line(f"{where}{e.format_message()}{hint}")
            sys.exit(e.exit_code)
        except typer.Abort:  # Ctrl-C outside a command (while parsing, importing, ...)
            error_line("interrupted", label="interrupted")
            sys.exit(130)
        sys.exit(code if isinstance(code, int) else 0)


def _forward_option_help(group: Any, args: list[str]) -> None:
    """`COMMAND --help` lists what `--option` can choose and `synth --help` every preset, from the
    registered families (options.REGISTRY_HELP); built only for a help screen, since the registry
    costs a numpy import that running a byte-moving command or `--help` itself need not pay."""
    from .options import REGISTRY_HELP

    if "--help" not in args:
        return
    for name, command in getattr(group, "commands", {}).items():
        params = [p for p in getattr(command, "params", []) if set(getattr(p, "opts", ())) & set(REGISTRY_HELP)]
        for param in params if name in args else []:
            (opt,) = set(param.opts) & set(REGISTRY_HELP)
            param.help = REGISTRY_HELP[opt]()


def handle_errors(fn: F) -> F:
    """Wrap a command in the one error path (module docstring)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        signal.signal(signal.SIGTERM, _raise_interrupt)
        timeline.mark("command")  # interpreter, imports and parsing done (issue 33: the split of a shell run)
        timeline.record_at_exit(fn.__name__)
        try:
            return fn(*args, **kwargs)
        except Plamo2Error as e:
            error_line(str(e))
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:
            left = INTERRUPTED.get(fn.__name__, "nothing was written")
            target = kwargs.get("out_dir") or kwargs.get("workdir") or kwargs.get("output")
            if target is None:  # e.g. generate --prompt, which writes no file
                left, target = ("nothing was written" if "{out}" in left else left), "the output"
            error_line(left.format(out=target), label="interrupted")
            raise typer.Exit(130) from None
        except (typer.Exit, clicks.ClickException):
            raise
        except ModuleNotFoundError as e:
            extra = missing_extra(fn.__name__, e.name)
            if extra is None:
                _bug(fn.__name__)
            name = command_name(fn.__name__)
            error_line(
                f"plamo2-tools {name} needs {e.name}, which is not installed: pip install 'plamo2-tools[{extra}]'"
            )
            raise typer.Exit(3) from None
        except OSError as e:
            if e.errno not in ENVIRONMENT_ERRNOS:
                _bug(fn.__name__)
            where = f"{e.filename}: " if e.filename else ""
            error_line(f"{where}{e.strerror or e}")
            raise typer.Exit(3) from None
        except MemoryError as e:
            error_line(out_of_memory_line(e))
            raise typer.Exit(3) from None
        except Exception as e:
            if is_out_of_memory(e):
                error_line(out_of_memory_line(e))
                raise typer.Exit(3) from None
            _bug(fn.__name__)

    return wrapper  # type: ignore[return-value]


# How torch says it ran out: CUDA's OutOfMemoryError ("Tried to allocate 2.00 GiB"), the CPU
# allocator's RuntimeError ("DefaultCPUAllocator: can't allocate memory: you tried to allocate
# 123456 bytes"), and plain MemoryError from numpy or Python.
_OOM_WORDS = ("can't allocate memory", "out of memory", "not enough memory")
_ASKED = re.compile(r"(?i)tried to allocate ([0-9]+ bytes|[0-9.]+ ?[KMGT]?i?B)")


def is_out_of_memory(e: BaseException) -> bool:
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":
        return True
    return isinstance(e, RuntimeError) and any(w in str(e).lower() for w in _OOM_WORDS)


def out_of_memory_line(e: BaseException) -> str:
    """One line with the size that was asked for when the allocator says it (exit 3)."""
    asked = _ASKED.search(str(e))
    device = "GPU" if "cuda" in str(e).lower() or type(e).__name__ == "OutOfMemoryError" else "CPU"
    size = f": {asked.group(1)} were asked for" if asked else ""
    return f"out of memory ({device}){size}: use fewer or shorter prompts, a smaller batch, or more memory"


def _bug(command: str) -> NoReturn:
    traceback.print_exc()
    name = command_name(command)
    error_line(
        f"plamo2-tools {__version__} `{name}` failed with the traceback above: this is a bug in plamo2-tools, "
        f"not in your input; please report it to {REPORT_BUGS_TO}",
        label="bug",
    )
    raise typer.Exit(BUG_EXIT_CODE) from None


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
