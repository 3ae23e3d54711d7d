"""Which tokenizer a checkpoint or shard directory gets (docs/tokenizer.md §5).

A directory with PLaMo's ``tokenizer.jsonl`` gets the native tokenizer (PLaMo 2's or PLaMo 3's, as
``hf.plamo_family_of`` reads the directory; `flavour`, the model family's, where it names no PLaMo
class) unless the user asks for the checkpoint's own code with
``trust_remote_code``; anything else goes to ``transformers.AutoTokenizer`` as before.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ..errors import EnvironmentLimitError, Plamo2Error, UserError
from .hf import PlamoTokenizerNative, model_vocab_size_of, plamo_family_of


def has_plamo_vocab(path: str | Path) -> bool:
    return (Path(path) / "tokenizer.jsonl").is_file()


def load_tokenizer(path: str | Path, trust_remote_code: bool = False, flavour: str | None = None) -> Any:
    """The tokenizer of a checkpoint or shard directory: native PLaMo when it has tokenizer.jsonl
    and remote code is not allowed, else transformers.AutoTokenizer (the real PLaMo 2 class then
    needs trust_remote_code and numba)."""
    if not Path(path).is_dir():
        raise UserError(f"{path} is not a directory (a checkpoint or shard directory holds the tokenizer)")
    if not trust_remote_code and has_plamo_vocab(path):
        return load_native(path, flavour)
    return _auto_tokenizer(path, trust_remote_code)


def load_native(path: str | Path, flavour: str | None = None) -> PlamoTokenizerNative:
    """PlamoTokenizerNative from a directory's tokenizer.jsonl, tokenizer_config.json and
    special_tokens_map.json (read by transformers, as for the checkpoint's own class); `flavour`
    where tokenizer_config.json names no PLaMo class (default "plamo2")."""
    import transformers

    transformers.logging.set_verbosity_error()
    directory = Path(path)
    if not has_plamo_vocab(directory):
        raise UserError(f"{directory}: no tokenizer.jsonl")
    try:
        family = plamo_family_of(directory, flavour or "plamo2")
        tokenizer = PlamoTokenizerNative.from_pretrained(str(directory), local_files_only=True, plamo_family=family)
    except Plamo2Error:
        raise
    except (OSError, ValueError, TypeError) as e:
        raise UserError(f"{directory}: cannot load the PLaMo tokenizer ({e})") from None
    size = model_vocab_size_of(directory)
    if size is not None:
        tokenizer.set_model_vocab_size(size)
    return tokenizer


def _auto_tokenizer(path: str | Path, trust_remote_code: bool) -> Any:
    import transformers

    transformers.logging.set_verbosity_error()
    try:
        return transformers.AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except ValueError as e:
        if "trust_remote_code" in str(e):
            raise UserError(f"{path}: the tokenizer is remote code; pass --trust-remote-code to load it") from None
        raise UserError(f"{path}: cannot load the tokenizer ({e})") from None
    except OSError as e:
        raise UserError(f"{path}: cannot load the tokenizer ({e})") from None
    except ImportError as e:  # the checkpoint's code imports a package this environment lacks
        name = missing_package(e)
        raise EnvironmentLimitError(
            f"{path}: the checkpoint's tokenizer code needs the package {name}, which is not installed "
            f"(pip install {name}), or drop --trust-remote-code to use the native PLaMo tokenizer"
        ) from None


def missing_package(e: ImportError) -> str:
    """The package an ImportError is about: transformers' own check lists them ("requires the
    following packages that were not found in your environment: numba"), Python names the module."""
    listed = re.search(r"not found in your environment: ([\w\-., ]+?)\.?( Run|$)", str(e))
    if listed:
        return listed.group(1).strip()
    return (e.name or str(e)).split(".")[0] or "unknown"
