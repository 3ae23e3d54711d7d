"""``plamo2-tools tokenize``: texts in, ids out, one JSON value per line (docs/tokenizer.md §7)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

from ..errors import UserError, os_error
from ..safe_files import create_fresh, write_error
from .loader import load_tokenizer


def run_tokenize(
    path: str | Path,
    input_file: str | Path | None = None,
    out_file: str | Path | None = None,
    decode: bool = False,
    skip_special_tokens: bool = False,
    trust_remote_code: bool = False,
    flavour: str | None = None,
) -> int:
    """Encode (or with ``decode`` decode) every line of ``input_file`` (stdin when None) with the
    tokenizer of ``path`` and write one JSON line per input line to ``out_file`` (stdout when None).

    Encoding gives ``tokenizer(text)["input_ids"]``, BOS/EOS as the tokenizer config says.  Blank
    lines are skipped.  Returns the number of lines written.  `flavour`: the model family's tokenizer
    flavour, where the directory's tokenizer config names no PLaMo class.
    """
    tokenizer = load_tokenizer(path, trust_remote_code=trust_remote_code, flavour=flavour)
    with _open_input(input_file) as (source, name), _open_output(out_file) as sink:
        records = _records(source, name, decode)
        if decode:
            results = (_decode_one(tokenizer, ids, skip_special_tokens, where) for where, ids in records)
        else:
            results = (tokenizer(text)["input_ids"] for _, text in records)
        count = 0
        try:
            for value in results:
                sink.write(json.dumps(value, ensure_ascii=False, separators=(",", ":")) + "\n")
                count += 1
            sink.flush()
        except OSError as e:  # a full disk names the output's filesystem, not an input
            raise write_error(e, Path(out_file or "stdout")) from None
    return count


def _records(lines: Iterable[str], name: str, decode: bool) -> Iterator[tuple[str, Any]]:
    """(where, value) for each non-blank line: a JSON string, or with ``decode`` a JSON array of ints."""
    want = "an array of token ids" if decode else "a string"
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{name}:{number}"
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{where}: not JSON ({e.msg}); each line must be {want}") from None
        except RecursionError:  # [[[[...: no line of ours nests
            raise UserError(f"{where}: nested too deeply; each line must be {want}") from None
        if decode:
            ok = isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        else:
            ok = isinstance(value, str)
        if not ok:
            raise UserError(f"{where}: expected {want}, got {type(value).__name__}")
        yield where, value


def _decode_one(tokenizer: Any, ids: list[int], skip_special_tokens: bool, where: str) -> str:
    try:
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    except (ValueError, IndexError, OverflowError) as e:
        raise UserError(f"{where}: cannot decode ({e})") from None


@contextmanager
def _open_input(input_file: str | Path | None) -> Iterator[tuple[TextIO, str]]:
    if input_file is None:
        yield sys.stdin, "stdin"
        return
    try:
        with open(input_file, encoding="utf-8") as f:
            yield f, str(input_file)
    except OSError as e:
        raise os_error(e, f"{input_file}: cannot read") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{input_file} is not UTF-8 text ({e.reason})") from None


@contextmanager
def _open_output(out_file: str | Path | None) -> Iterator[TextIO]:
    """stdout, or a file written as FILE.partial and renamed when complete.  FILE.partial is ours:
    created fresh (a leftover of a killed run, or a planted link, is replaced, never written
    through) and removed when the run stops early (a refused line, Ctrl-C), so nothing is left."""
    if out_file is None:
        yield sys.stdout
        sys.stdout.flush()
        return
    final = Path(out_file)
    partial = final.with_name(final.name + ".partial")
    handle = os.fdopen(create_fresh(partial, os.O_WRONLY), "w", encoding="utf-8")
    try:
        with handle:
            yield handle
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, final)
