"""Pair inputs (`tok(a, b)`, lm-eval's and transformers' sentence pairs) by PLaMo's own rule.

PLaMo's tokenization_plamo.py builds special tokens like Llama's slow tokenizer: each sequence gets
its own BOS (when add_bos_token) and EOS (when add_eos_token), so a pair is
    [BOS] a [EOS] [BOS] b [EOS]
and the special-tokens mask marks exactly those positions.  The expected lists are written out
here from that rule; the ids of a and b alone come from the tokenizer without special tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plamo2_tools.tokenizer import PlamoTokenizerNative, write_synthetic_tokenizer

A, B = "Question: 2 + 3?", "東京👍 answer 5"
BOS, EOS = 1, 2


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tok")
    write_synthetic_tokenizer(directory, vocab_size=1200, rows=1100)
    (directory / "config.json").write_text(json.dumps({"vocab_size": 1200}))
    return directory / "tokenizer.jsonl"


@pytest.mark.parametrize(("bos", "eos"), [(True, False), (True, True), (False, True), (False, False)])
def test_pair_gets_specials_around_each_sequence(jsonl: Path, bos: bool, eos: bool) -> None:
    tok = PlamoTokenizerNative(str(jsonl), add_bos_token=bos, add_eos_token=eos)
    a = tok(A, add_special_tokens=False)["input_ids"]
    b = tok(B, add_special_tokens=False)["input_ids"]
    head, tail = [BOS] * bos, [EOS] * eos
    want = [*head, *a, *tail, *head, *b, *tail]
    got = tok(A, B, return_special_tokens_mask=True)
    assert got["input_ids"] == want
    mask = [*[1] * bos, *[0] * len(a), *[1] * eos, *[1] * bos, *[0] * len(b), *[1] * eos]
    assert got["special_tokens_mask"] == mask
    assert tok([(A, B), (B, A)])["input_ids"][0] == want  # a batch of pairs: the same rule per pair
    assert tok(A)["input_ids"] == [*head, *a, *tail]  # and a single sequence: its own specials only
