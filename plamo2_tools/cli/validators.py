"""Checks of command-line values made before any long work starts, each failing with one line."""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path
from typing import Any

from ..errors import EnvironmentLimitError, UserError


def require(*modules: str) -> None:
    """Refuse before any writing when an optional module a choice needs is not installed; the
    command's error path names the extra that provides it (cli/errors.py EXTRAS)."""
    for module in modules:
        if importlib.util.find_spec(module) is None:
            raise ModuleNotFoundError(f"No module named {module!r}", name=module)


def int_list(text: str | None, what: str) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{what} must be comma-separated integers, got {text!r}") from None


def check_output_file(path: Path, option: str) -> None:
    """A file written when the work is done: refused now, not after it, when it cannot be written."""
    if path.is_dir():
        raise UserError(f"{option} {path}: is a directory, not a file")
    parent = path.parent
    if not parent.is_dir():
        raise UserError(f"{option} {path}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise EnvironmentLimitError(f"{option} {path}: cannot write in {parent} (permission denied or read-only)")


def check_output_dir(path: Path, option: str) -> None:
    """A directory created (if needed) when results are written: the nearest existing ancestor must
    be a writable directory."""
    for p in (path, *path.parents):
        if p.exists():
            if not p.is_dir():
                raise UserError(f"{option} {path}: {p} is not a directory")
            if not os.access(p, os.W_OK):
                raise EnvironmentLimitError(f"{option} {path}: cannot write in {p} (permission denied or read-only)")
            return


def check_sampling(temperature: float, top_p: float, max_new_tokens: int) -> None:
    if not math.isfinite(temperature) or temperature < 0:  # nan and inf pass a bare `< 0`
        raise UserError(f"--temperature {temperature:g}: must be >= 0 and finite (0 = greedy)")
    if not 0 < top_p <= 1:
        raise UserError(f"--top-p {top_p:g}: must be in (0, 1]")
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens {max_new_tokens}: must be >= 1")


def check_runtime_options(device: str, backend: str) -> None:
    from ..kernels.devices import check_backend, check_device

    check_device(device)
    check_backend(backend, device)


def forward_options(items: list[str] | None) -> dict[str, str]:
    """`--option KEY=VALUE` (repeatable) as a dict; the family checks keys and values when the
    model loads (`Family.check_runtime_options`)."""
    options: dict[str, str] = {}
    for item in items or []:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise UserError(f"--option {item!r}: expected KEY=VALUE")
        if key.strip() in options:
            raise UserError(f"--option {key.strip()}: given twice")
        options[key.strip()] = value.strip()
    return options


def runtime_args(
    shards: Path,
    device: str,
    backend: str,
    option: list[str] | None,
    no_verify: bool = False,
    trust_remote_code: bool = False,
    cuda_graph: bool = True,
) -> dict[str, Any]:
    """The `Runtime` keyword arguments of the options every command that serves the model shares,
    checked once (device, backend, the `--option` syntax; the family checks the options' names
    and values when the shards load)."""
    check_runtime_options(device, backend)
    return {
        "shards": str(shards),
        "device": device,
        "backend": backend,
        "trust_remote_code": trust_remote_code,
        "cuda_graph": cuda_graph,
        "verify_files": not no_verify,
        "forward_options": forward_options(option),
    }


def is_shard_dir(path: Path) -> bool:
    """A shard directory, finished or not (an unfinished one is then refused with its own words)."""
    from ..shards.manifest import JOURNAL_NAME, MANIFEST_NAME

    return (path / MANIFEST_NAME).exists() or (path / JOURNAL_NAME).exists()


def parse_limit(text: str | None) -> int | float | None:
    """lm-eval's --limit: N documents, or a fraction of them when below 1."""
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        raise UserError(f"--limit must be a number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise UserError(f"--limit must be > 0 and finite, got {text!r}")
    return int(value) if value >= 1 and value.is_integer() else value


def parse_batch_size(text: str) -> int | str:
    """--batch-size: a positive integer or "auto"."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise UserError(f'--batch-size must be a number or "auto", got {text!r}') from None


def parse_max_batch(text: str) -> int | str:
    """--max-batch of generate --input and serve: decode slots (>= 1) or "auto"."""
    batch = parse_batch_size(text)
    if batch != "auto" and int(batch) < 1:
        raise UserError(f"--max-batch {text}: must be >= 1 or auto")
    return batch


def check_eval_numbers(
    batch_size: int | str, max_gen_toks: int, max_length: int | None, num_fewshot: int | None, bootstrap_iters: int
) -> None:
    if batch_size != "auto" and int(batch_size) < 1:
        raise UserError(f"--batch-size {batch_size}: must be >= 1")
    if max_gen_toks < 1:
        raise UserError(f"--max-gen-toks {max_gen_toks}: must be >= 1")
    if max_length is not None and max_length <= max_gen_toks:
        raise UserError(f"--max-length {max_length}: must exceed --max-gen-toks ({max_gen_toks})")
    if num_fewshot is not None and num_fewshot < 0:
        raise UserError(f"--num-fewshot {num_fewshot}: must be >= 0")
    if bootstrap_iters < 0:
        raise UserError(f"--bootstrap-iters {bootstrap_iters}: must be >= 0")
