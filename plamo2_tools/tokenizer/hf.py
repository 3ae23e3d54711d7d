"""``PlamoTokenizerNative``: PLaMo's tokenizer as a ``transformers`` tokenizer, no remote code, no numba.

It behaves like the checkpoint's own ``Plamo2Tokenizer`` (docs/tokenizer.md §5): the same
constructor arguments and defaults (``add_bos_token``/``add_eos_token`` false unless the config
says otherwise), special tokens split out of the text by ``transformers`` before encoding, token
strings mapped back to ids through the vocabulary (last row wins) and the added tokens, BOS/EOS
added by ``build_inputs_with_special_tokens``, and decoding that turns ``<0x..>`` pieces back into
bytes and the rest into UTF-8 with replacement.  Two shortcuts keep it fast and change nothing:
a text that contains no added token skips the split, and the token strings of ``tokenize`` carry
their ids so ``convert_tokens_to_ids`` need not look them up again.

Ids from ``tokenizer.jsonl``'s row count up to the model's ``vocab_size`` (PLaMo 2: rows 100000,
embedding 100032) have no row; they decode to nothing instead of failing.

A directory whose ``tokenizer_config.json`` names ``Plamo3Tokenizer`` (or, naming no PLaMo class,
whose model family declares the "plamo3" flavour, `Family.tokenizer_flavour`) gets PLaMo 3's behaviour instead: the same
constructor plus the two ``break_around_*_threshold`` arguments, and PLaMo 3's cuts in the encoder
(docs/tokenizer.md §9), applied to each piece of text ``transformers`` leaves between added tokens.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from shutil import copyfile
from typing import Any

# The base install has no PyTorch by design (pyproject.toml): transformers' import-time advice that
# "PyTorch was not found" would be a stray stderr line of every `tokenize` there.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
from transformers import PreTrainedTokenizer  # noqa: E402

from ..errors import Plamo2Error
from ..jsonio import read_json
from .encoder import PlamoEncoder
from .plamo3 import Plamo3Cuts
from .vocab import FLAVOURS, read_rows

VOCAB_FILES_NAMES = {"vocab_file": "tokenizer.jsonl"}
FAMILIES = {cls: flavour for flavour, cls in FLAVOURS.items()}  # PLaMo's class -> its flavour
THRESHOLDS = ("break_around_consecutive_spaces_threshold", "break_around_repeated_chars_threshold")


class _Pieces(list):  # type: ignore[type-arg]
    """Token strings from ``tokenize`` with the ids they convert to (checked before use)."""

    __slots__ = ("ids", "pieces")


class PlamoTokenizerNative(PreTrainedTokenizer):
    """PLaMo's tokenizer.jsonl with the exact ids of ``tokenization_plamo.Plamo2Tokenizer``, or of its
    ``Plamo3Tokenizer`` when ``plamo_family`` is "plamo3" (None: found from the vocabulary file's
    directory, see plamo_family_of)."""

    vocab_files_names = VOCAB_FILES_NAMES
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(
        self,
        vocab_file: str,
        unk_token: str = "<|plamo:unk|>",
        bos_token: str = "<|plamo:bos|>",
        eos_token: str = "<|plamo:eos|>",
        pad_token: str = "<|plamo:pad|>",
        cls_token: str | None = None,
        sep_token: str | None = None,
        mask_token: str | None = None,
        clean_up_tokenization_spaces: bool = False,
        plamo_family: str | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("add_bos_token", False)
        kwargs.setdefault("add_eos_token", False)
        self.vocab_file = str(vocab_file)
        self.plamo_family = plamo_family or plamo_family_of(Path(vocab_file).parent)
        self._plamo3: Plamo3Cuts | None = None
        if self.plamo_family == "plamo3":
            for key in THRESHOLDS:  # Plamo3Tokenizer keeps both and hands them on (None when unset)
                kwargs.setdefault(key, None)
                setattr(self, key, kwargs[key])
            self._plamo3 = Plamo3Cuts(
                repeated_chars_threshold=kwargs["break_around_repeated_chars_threshold"],
                consecutive_spaces_threshold=kwargs["break_around_consecutive_spaces_threshold"],
            )
        elif self.plamo_family != "plamo2":
            raise ValueError(f"plamo_family must be 'plamo2' or 'plamo3', not {self.plamo_family!r}")
        self.data: list[Any] = read_rows(vocab_file)
        self.encoder = PlamoEncoder(self.data, self.vocab_file, self._plamo3)
        self.vocab: dict[str, int] = {row[0]: i for i, row in enumerate(self.data)}
        self._piece_of: list[str] = [row[0] for row in self.data]
        self.add_bos_token = bool(kwargs["add_bos_token"])
        self.add_eos_token = bool(kwargs["add_eos_token"])
        self.model_vocab_size = len(self.data)
        self._id_map: list[int] | None = None  # encoder id -> id after the string round trip
        self._decode_table: list[bytes | None] | None = None
        super().__init__(
            vocab_file=vocab_file,
            unk_token=unk_token,
            bos_token=bos_token,
            eos_token=eos_token,
            pad_token=pad_token,
            cls_token=cls_token,
            sep_token=sep_token,
            mask_token=mask_token,
            clean_up_tokenization_spaces=clean_up_tokenization_spaces,
            **kwargs,
        )

    # ---- vocabulary ----------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Rows of tokenizer.jsonl (as PLaMo's class reports it; see model_vocab_size)."""
        return len(self.data)

    def set_model_vocab_size(self, size: int) -> None:
        """Ids below ``size`` without a row (the embedding's padding) decode to nothing."""
        self.model_vocab_size = max(int(size), len(self.data))
        self._decode_table = None

    def get_vocab(self) -> dict[str, int]:
        vocab = self.vocab.copy()
        vocab.update(self.added_tokens_encoder)
        return vocab

    def token_to_score(self, token: str) -> float | None:
        token_id = self.vocab.get(token)
        return None if token_id is None else self.data[token_id][1]

    def _add_tokens(self, new_tokens: Any, special_tokens: bool = False) -> int:
        added = super()._add_tokens(new_tokens, special_tokens=special_tokens)
        self._id_map = None  # a piece string may now be an added token with another id
        self._decode_table = None
        return added

    # ---- encoding ------------------------------------------------------------------------------
    def tokenize(self, text: str, **kwargs: Any) -> list[str]:
        """transformers' tokenize; when no added token occurs in the text there is nothing to split out."""
        split_special_tokens = kwargs.get("split_special_tokens", self.split_special_tokens)
        trie_tokens = getattr(getattr(self, "tokens_trie", None), "_tokens", None)
        if trie_tokens is None or (not split_special_tokens and any(t in text for t in trie_tokens)):
            return super().tokenize(text, **kwargs)
        kwargs.pop("split_special_tokens", None)
        text, _ = self.prepare_for_tokenization(text, **kwargs)
        return self._tokenize(text)

    def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
        ids = self.encoder.encode(text)
        out = _Pieces(map(self._piece_of.__getitem__, ids))
        id_map = self._round_trip_ids()
        out.ids = ids if id_map is None else [id_map[i] for i in ids]
        out.pieces = out[:]
        return out

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | list[int]:  # type: ignore[override]
        if type(tokens) is _Pieces and list.__eq__(tokens, tokens.pieces):  # unchanged since tokenize
            return tokens.ids
        return super().convert_tokens_to_ids(tokens)

    def _round_trip_ids(self) -> list[int] | None:
        """None when every encoder id survives id -> piece -> id unchanged (the usual case), else
        the map: PLaMo's tokenizer returns piece strings, which transformers maps back through the
        added tokens first and then the vocabulary, where a repeated piece keeps its last row."""
        if self._id_map is None:
            added = self._added_tokens_encoder
            mapped = [added.get(row[0], self.vocab[row[0]]) for row in self.data]
            self._id_map = [] if mapped == list(range(len(mapped))) else mapped
        return self._id_map or None

    def _convert_token_to_id(self, token: str) -> int:
        return self.vocab.get(token, 0)

    def _convert_id_to_token(self, index: int) -> str:
        if 0 <= index < len(self.data):
            return self.data[index][0]
        if len(self.data) <= index < self.model_vocab_size:
            return ""
        raise ValueError(f"token id {index} is outside the vocabulary [0, {self.model_vocab_size})")

    def build_inputs_with_special_tokens(
        self, token_ids_0: list[int], token_ids_1: list[int] | None = None
    ) -> list[int]:
        bos = [self.bos_token_id] if self.add_bos_token else []
        eos = [self.eos_token_id] if self.add_eos_token else []
        output = bos + token_ids_0 + eos
        if token_ids_1 is not None:
            output = output + bos + token_ids_1 + eos
        return output

    def get_special_tokens_mask(
        self, token_ids_0: list[int], token_ids_1: list[int] | None = None, already_has_special_tokens: bool = False
    ) -> list[int]:
        if already_has_special_tokens:
            return super().get_special_tokens_mask(token_ids_0, token_ids_1, already_has_special_tokens=True)
        bos = [1] if self.add_bos_token else []
        eos = [1] if self.add_eos_token else []
        mask = bos + [0] * len(token_ids_0) + eos
        if token_ids_1 is not None:
            mask += bos + [0] * len(token_ids_1) + eos
        return mask

    # ---- decoding ------------------------------------------------------------------------------
    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        """PLaMo's rule: a token starting with "<0x" is the byte it names, anything else its UTF-8."""
        return b"".join(bytes([int(t[3:5], 16)]) if t.startswith("<0x") else t.encode("utf-8") for t in tokens).decode(
            "utf-8", errors="replace"
        )

    def decode_kept(self, token_ids: Sequence[int]) -> str:
        """`decode(ids, skip_special_tokens=False, spaces_between_special_tokens=False,
        clean_up_tokenization_spaces=False)`, the text vLLM shows, without transformers' wrapper
        around `_decode` (half the cost: the runtime's stop-string watcher decodes a window of every
        sequence every few steps, issue 33)."""
        return self._decode(token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def _decode(
        self,
        token_ids: int | Sequence[int],
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
        **kwargs: Any,
    ) -> str:
        """convert_ids_to_tokens + convert_tokens_to_string, through a per-id table of bytes."""
        ids = [int(token_ids)] if isinstance(token_ids, int) else [int(i) for i in token_ids]
        if skip_special_tokens:
            drop = set(self.all_special_ids)
            ids = [i for i in ids if i not in drop]
        table = self._bytes_table()
        if ids and (min(ids) < 0 or max(ids) >= len(table)):
            bad = next(i for i in ids if not 0 <= i < len(table))
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {len(table)})")
        chunks = [table[i] for i in ids]
        if None in chunks:  # a piece like "<0xZZ": PLaMo's decoder fails on it the same way
            return self.convert_tokens_to_string(self.convert_ids_to_tokens(ids))
        text = b"".join(chunks).decode("utf-8", errors="replace")  # type: ignore[arg-type]
        if clean_up_tokenization_spaces is None:
            clean_up_tokenization_spaces = self.clean_up_tokenization_spaces
        return self.clean_up_tokenization(text) if clean_up_tokenization_spaces else text

    def _bytes_table(self) -> list[bytes | None]:
        if self._decode_table is None:
            size = max([self.model_vocab_size, len(self.data), *(i + 1 for i in self._added_tokens_decoder)])
            table: list[bytes | None] = [b""] * size
            for i, row in enumerate(self.data):
                table[i] = _token_bytes(row[0])
            for i, token in self._added_tokens_decoder.items():
                table[i] = _token_bytes(token.content)
            self._decode_table = table
        return self._decode_table

    # ---- files and pickling --------------------------------------------------------------------
    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str]:
        if not os.path.isdir(save_directory):
            raise ValueError(f"vocabulary path {save_directory} should be a directory")
        name = (filename_prefix + "-" if filename_prefix else "") + VOCAB_FILES_NAMES["vocab_file"]
        out = os.path.join(save_directory, name)
        if os.path.abspath(self.vocab_file) != os.path.abspath(out) and os.path.isfile(self.vocab_file):
            copyfile(self.vocab_file, out)
        elif not os.path.isfile(self.vocab_file):
            with open(out, "w", encoding="utf-8") as f:
                for row in self.data:
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
        return (out,)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["encoder"] = None  # rebuilt from the rows: its caches are not worth shipping
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__ = state
        self.encoder = PlamoEncoder(self.data, self.vocab_file, self._plamo3)


def _token_bytes(token: str) -> bytes | None:
    if token.startswith("<0x"):
        digits = token[3:5]
        return bytes([int(digits, 16)]) if len(digits) == 2 and _is_hex(digits) else None
    return token.encode("utf-8")


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdefABCDEF" for c in text)


def model_vocab_size_of(directory: str | Path) -> int | None:
    """config.json's vocab_size, when the directory has one."""
    path = Path(directory) / "config.json"
    value = _json_object(path)
    size = value.get("vocab_size")
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def plamo_family_of(directory: str | Path, default: str = "plamo2") -> str:
    """The flavour, "plamo3" or "plamo2": the PLaMo class that tokenizer_config.json names (auto_map's
    AutoTokenizer entry, which is what remote code would load, else tokenizer_class); naming
    neither, `default`: the flavour the model family of the directory declares
    (`model.registry.tokenizer_flavour`, e.g. "plamo3" for a PLaMo 3 config.json)."""
    directory = Path(directory)
    config = _json_object(directory / "tokenizer_config.json")
    auto = config.get("auto_map")
    ref = auto.get("AutoTokenizer") if isinstance(auto, dict) else None
    if isinstance(ref, (list, tuple)):
        ref = next((r for r in ref if r), None)
    for name in (ref, config.get("tokenizer_class")):
        if isinstance(name, str) and name.rsplit(".", 1)[-1] in FAMILIES:
            return FAMILIES[name.rsplit(".", 1)[-1]]
    return default


def _json_object(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        value = read_json(path)  # bounded: a FIFO, a huge or deeply nested file is no object
    except Plamo2Error:
        return {}
    return value if isinstance(value, dict) else {}
