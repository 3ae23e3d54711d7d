"""The key/value part of a GGUF export, key for key what llama.cpp's converter writes, in its order,
plus the few keys it loses that llama.cpp reads (docs/export.md, "GGUF", "What we add").

The converter's order: `general.architecture`, `general.type`, the model card (`gguf.Metadata`:
name, size label, license, tags... from README.md, config.json and generation_config.json), the
family's `set_gguf_parameters`, `general.quantization_version`, then the tokenizer
(`_set_vocab_plamo`: PLaMo's tokenizer.jsonl, padded to vocab_size with [PADi] rows, the special
ids named in tokenizer_config.json, end-of-turn, no space prefix; PLaMo 3 adds the chat template).
The model card goes through the `gguf` package's own `Metadata.load`, on bounded copies of those
three files (a planted link or a huge README never reaches it).

What we add after those, because llama.cpp reads it and the converter does not write it:
`tokenizer.ggml.add_bos_token` (the converter leaves it out and llama.cpp then never adds BOS for a
PLaMo vocabulary, while PLaMo's tokenizer does), and our own key `plamo2_tools.export` (how the
file was made; it is also how a later export knows the file is ours to replace).  The end-of-turn
id is the id of `<|plamo:op|>` where the converter hard-codes 4 (the same id in PLaMo's
vocabularies; a vocabulary without that piece gets no end-of-turn id and a note).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf

from ..errors import Plamo2Error, UserError
from ..jsonio import CONFIG_BYTES, MiB, parse_json
from ..model.gguf import GGUFArch
from ..safe_files import ensure_inside_source, read_regular
from ..tokenizer.vocab import read_rows
from ..version import __version__

OWN_KEY = "plamo2_tools.export"
MODEL_CARD_FILES = {"README.md": 4 * MiB, "config.json": CONFIG_BYTES, "generation_config.json": CONFIG_BYTES}
EOT_PIECE = "<|plamo:op|>"
SPECIAL_IDS = (
    ("bos_token", "add_bos_token_id"),
    ("eos_token", "add_eos_token_id"),
    ("pad_token", "add_pad_token_id"),
    ("sep_token", "add_sep_token_id"),
    ("unk_token", "add_unk_token_id"),
)


@dataclass
class Vocab:
    tokens: list[bytes]
    scores: list[float]
    types: list[int]
    calls: list[tuple[str, tuple[Any, ...]]]  # the tokenizer keys, in the converter's order
    additions: list[tuple[str, tuple[Any, ...]]] = field(default_factory=list)  # ours, after everything
    notes: list[str] = field(default_factory=list)


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _token_type(row: list[Any]) -> int:
    kind = row[2] if len(row) > 2 else "NORMAL"
    named = {"UNKNOWN": gguf.TokenType.UNKNOWN, "CONTROL": gguf.TokenType.CONTROL, "BYTE": gguf.TokenType.BYTE}
    if kind in named:
        return int(named[kind])
    piece = row[0]
    return int(
        gguf.TokenType.CONTROL if piece.startswith("<|plamo:") and piece.endswith("|>") else gguf.TokenType.NORMAL
    )


def _special_text(value: Any) -> str | None:
    """A special token in tokenizer_config.json: a string, or an AddedToken object's content."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def read_tokenizer_config(src: Path) -> dict[str, Any]:
    path = src / "tokenizer_config.json"
    if not path.exists() and not path.is_symlink():
        raise UserError(f"{path}: missing (llama.cpp's PLaMo vocabulary needs it)")
    raw = parse_json(read_regular(ensure_inside_source(src, path), CONFIG_BYTES), str(path))
    if not isinstance(raw, dict):
        raise UserError(f"{path}: not a JSON object")
    return raw


def vocab(src: Path, vocab_size: int, arch: GGUFArch) -> Vocab:
    """`_set_vocab_plamo` (and PLaMo 3's chat template) from the checkpoint's own files."""
    path = src / "tokenizer.jsonl"
    if not path.exists() and not path.is_symlink():
        raise UserError(f"{path}: missing (llama.cpp reads PLaMo's vocabulary from it)")
    rows = read_rows(ensure_inside_source(src, path))
    for i, row in enumerate(rows):
        if not (
            isinstance(row, list)
            and len(row) >= 2
            and isinstance(row[0], str)
            and isinstance(row[1], (int, float))
            and not isinstance(row[1], bool)
        ):
            raise UserError(f"{path}: row {i} is not a [piece, score, type] array")
    try:
        tokens = [row[0].encode("utf-8") for row in rows]
    except UnicodeEncodeError as e:  # JSON allows lone surrogates ("\ud800"), UTF-8 does not
        bad = next(i for i, row in enumerate(rows) if not _utf8(row[0]))
        raise UserError(
            f"{path}: row {bad}'s piece is not valid Unicode ({e.reason}): not a PLaMo vocabulary"
        ) from None
    scores = [float(row[1]) for row in rows]
    types = [_token_type(row) for row in rows]
    for i in range(1, vocab_size - len(tokens) + 1):
        tokens.append(f"[PAD{i}]".encode())
        scores.append(-1000.0)
        types.append(int(gguf.TokenType.UNUSED))
    config = read_tokenizer_config(src)
    out = Vocab(
        tokens,
        scores,
        types,
        [
            ("add_tokenizer_model", ("plamo2",)),
            ("add_tokenizer_pre", ("default",)),
            ("add_token_list", (tokens,)),
            ("add_token_scores", (scores,)),
            ("add_token_types", (types,)),
        ],
    )
    first = {}
    for i, t in enumerate(tokens):
        first.setdefault(t, i)
    for key, method in SPECIAL_IDS:
        text = _special_text(config.get(key))
        if config.get(key) is None:
            continue
        if text is None or text.encode() not in first:
            out.notes.append(
                f"tokenizer_config.json {key} {config[key]!r:.60} is not a piece of tokenizer.jsonl: "
                "not written (llama.cpp's converter fails on it)"
            )
            continue
        out.calls.append((method, (first[text.encode()],)))
    if EOT_PIECE.encode() in first:
        out.calls.append(("add_eot_token_id", (first[EOT_PIECE.encode()],)))
    else:
        out.notes.append(
            f"no {EOT_PIECE} piece: no end-of-turn id written (llama.cpp's converter writes 4, "
            f"which is {tokens[4]!r} here)"
            if len(tokens) > 4
            else f"no {EOT_PIECE} piece"
        )
    out.calls.append(("add_add_space_prefix", (False,)))
    if arch.chat_template:
        template = chat_template(src, config)
        if template:
            out.calls.append(("add_chat_template", (template,)))
    if isinstance(config.get("add_bos_token"), bool):
        out.additions.append(("add_add_bos_token", (config["add_bos_token"],)))
    return out


def chat_template(src: Path, config: dict[str, Any]) -> str | None:
    """tokenizer_config.json's chat_template, replaced by chat_template.jinja when that file exists."""
    template = config.get("chat_template")
    path = src / "chat_template.jinja"
    if path.is_file():
        data = read_regular(ensure_inside_source(src, path), CONFIG_BYTES)
        try:
            template = data.decode("utf-8")
        except UnicodeDecodeError:
            raise UserError(f"{path}: not UTF-8 text") from None
    return template if isinstance(template, str) and template else None


def model_card(src: Path, name: str, total_params: tuple[int, int, int, int]) -> tuple[gguf.Metadata, list[str]]:
    """`gguf.Metadata.load` as the converter calls it, on bounded copies of the files it reads, in a
    private directory of the source's name (its heuristics read the name)."""
    notes = []
    with tempfile.TemporaryDirectory(prefix="plamo2-gguf-card-") as tmp:
        staged = Path(tmp) / (name or "model")
        staged.mkdir()
        for fname, limit in MODEL_CARD_FILES.items():
            path = src / fname
            if not path.exists():
                continue
            try:
                data = read_regular(ensure_inside_source(src, path), limit)
            except Plamo2Error as e:
                notes.append(f"{fname} not read for the model card ({e})")
                continue
            (staged / fname).write_bytes(data)
        try:
            card = gguf.Metadata.load(None, staged, None, total_params[0])
        except Exception as e:  # the model card is metadata: a bad README must not stop an export
            notes.append(f"model card not read ({type(e).__name__}: {str(e)[:80]})")
            card = gguf.Metadata()
    if card.name is None:
        card.name = name
    if card.size_label is None and total_params[0] > 0:
        card.size_label = gguf.size_label(*total_params)
    return card, notes


def own_value(type_name: str, overrides: list[tuple[str, str]], source: str) -> str:
    """Our key's value: the export's recipe, as JSON text."""
    rules = [f"{p}={t}" for p, t in overrides]
    record = {"tool": "plamo2-tools", "version": __version__, "type": type_name, "tensor_types": rules}
    record["source"] = source
    return json.dumps(record, sort_keys=True)


def call(writer: gguf.GGUFWriter, method: str, args: tuple[Any, ...]) -> None:
    """One converter call on the writer (the family tables name methods, not types)."""
    if method == "add_rope_scaling_type":
        args = (gguf.RopeScalingType(args[0]),)
    getattr(writer, method)(*args)
