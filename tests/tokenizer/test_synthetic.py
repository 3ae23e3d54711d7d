"""Synthetic PLaMo-format tokenizers: structure, config keys, determinism, and real choices."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plamo2_tools.errors import UserError
from plamo2_tools.tokenizer import PlamoEncoder, load_tokenizer, synthetic_rows, write_synthetic_tokenizer
from plamo2_tools.tokenizer.synthetic import CONTROL_TOKENS, FIRST_PIECE_ID, learn_pieces


def test_rows_have_plamos_structure() -> None:
    rows = synthetic_rows(1000, seed=3)
    assert len(rows) == 1000
    assert rows[0] == ["<|plamo:unk|>", 0.0, "UNKNOWN"]
    assert [r[0] for r in rows[1:5]] == ["<|plamo:bos|>", "<|plamo:eos|>", "<|plamo:pad|>", "<|plamo:op|>"]
    assert all(r[2] == "CONTROL" for r in rows[1:7])
    assert [r[0] for r in rows[7:FIRST_PIECE_ID]] == [f"<0x{b:02X}>" for b in range(256)]
    assert all(r[2] == "BYTE" for r in rows[7:FIRST_PIECE_ID])
    pieces = rows[FIRST_PIECE_ID:]
    assert all(r[2] == "NORMAL" and r[1] < 0 for r in pieces)
    assert len({r[0] for r in rows}) == len(rows)
    assert [r[1] for r in pieces] == sorted((r[1] for r in pieces), reverse=True)


def test_sizes() -> None:
    assert len(synthetic_rows(515)) == 515
    assert len(synthetic_rows(2000, rows=1500)) == 1500
    with pytest.raises(UserError, match="does not fit"):
        synthetic_rows(400, rows=500)
    with pytest.raises(UserError, match="too small"):
        synthetic_rows(FIRST_PIECE_ID - 1)


def test_deterministic_and_seeded() -> None:
    assert synthetic_rows(6000, seed=1) == synthetic_rows(6000, seed=1)
    # ~4000 pieces come from the corpus; the generated rest differs by seed.
    assert synthetic_rows(6000, seed=1) != synthetic_rows(6000, seed=2)


def test_learned_pieces_make_real_choices() -> None:
    """Word pieces with their leading space, pieces that overlap, and a segmentation that is not
    simply the longest match from the left."""
    pieces = dict(learn_pieces(3000))
    assert {" the", " many", "Question", "、"} <= set(pieces)
    rows = synthetic_rows(3000)
    encoder = PlamoEncoder(rows)
    ids = encoder.encode("How many apples does the farmer plant? 農家はりんごを植えます。")
    assert len(ids) < 40 and any(len(rows[i][0]) > 3 for i in ids)
    greedy_differs = False
    for word in [" Japanese", " wonderful", " countries", " teachers", " thinking", " mountains"]:  # not in corpus
        best = [rows[i][0] for i in encoder.encode(word)]
        greedy, rest = [], word
        while rest:
            longest = max((p for p in pieces if rest.startswith(p)), key=len)
            greedy.append(longest)
            rest = rest[len(longest) :]
        greedy_differs |= best != greedy
    assert greedy_differs


def test_files_and_config_keys(tmp_path: Path) -> None:
    write_synthetic_tokenizer(tmp_path, vocab_size=600, add_bos_token=True)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "Plamo2Tokenizer"
    assert config["auto_map"] == {"AutoTokenizer": ["tokenization_plamo.Plamo2Tokenizer", None]}
    assert (config["bos_token"], config["eos_token"], config["pad_token"], config["unk_token"]) == tuple(
        CONTROL_TOKENS[i] for i in (1, 2, 3, 0)
    )
    assert config["add_bos_token"] is True and config["add_eos_token"] is False
    assert set(config["added_tokens_decoder"]) == {"0", "1", "2", "3"}
    special = json.loads((tmp_path / "special_tokens_map.json").read_text())
    assert special["eos_token"]["content"] == "<|plamo:eos|>"
    tok = load_tokenizer(tmp_path)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 3)
    assert tok("Question: 1+1?")["input_ids"][0] == 1
