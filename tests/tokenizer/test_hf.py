"""PlamoTokenizerNative as transformers and lm-eval use it: special tokens, BOS/EOS, batches,
decoding, ids without a row, saving and pickling."""

from __future__ import annotations

import json
import pickle
import random
from pathlib import Path

import pytest
from tokenizer_reference import Reference, random_text

from plamo2_tools.tokenizer import PlamoTokenizerNative, load_native, write_synthetic_tokenizer
from plamo2_tools.tokenizer.synthetic import CONTROL_TOKENS

TEXTS = [
    "Question: Tom had 250 stamps.\nAnswer: 250 - 75 = <<250-75=175>>175",
    "東京から大阪まで、約二時間半。",
    "emoji 👍🏽 and e\u0301 and \x00 and \ufeff",
    "",
    "   ",
    "a<|plamo:eos|>b<|plamo:bos|>",
    "<|plamo:op|>dataset\ntranslation",
]


@pytest.fixture(scope="module")
def tokdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tok")
    write_synthetic_tokenizer(directory, vocab_size=1200, rows=1100)
    (directory / "config.json").write_text(json.dumps({"vocab_size": 1200}))
    return directory


@pytest.fixture(scope="module")
def tok(tokdir: Path) -> PlamoTokenizerNative:
    return load_native(tokdir)


def rows_of(directory: Path) -> list[list[object]]:
    return [json.loads(line) for line in (directory / "tokenizer.jsonl").read_text(encoding="utf-8").splitlines()]


def test_config_gives_plamo_specials_and_bos(tok: PlamoTokenizerNative) -> None:
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2, 3)
    assert tok.unk_token == CONTROL_TOKENS[0] and tok.eos_token == CONTROL_TOKENS[2]
    assert tok.add_bos_token and not tok.add_eos_token
    assert tok.vocab_size == 1100 and tok.model_vocab_size == 1200 and len(tok) == 1100


@pytest.mark.parametrize("text", TEXTS)
def test_input_ids_are_bos_plus_plamos_ids(tok: PlamoTokenizerNative, tokdir: Path, text: str) -> None:
    """Outside special tokens the ids are the independent DP's; special tokens are split out first."""
    reference = Reference(rows_of(tokdir))
    expected = [1]
    marked = text.replace("<|plamo:eos|>", "\ue000E\ue000").replace("<|plamo:bos|>", "\ue000B\ue000")
    for i, segment in enumerate(marked.split("\ue000")):
        if i % 2:
            expected.append({"E": 2, "B": 1}[segment])
        elif segment:
            expected += reference.plain_dp(segment)
    assert tok(text)["input_ids"] == expected
    assert tok.encode(text) == expected
    assert tok(text)["attention_mask"] == [1] * len(expected)


def test_control_pieces_that_are_not_special_tokens_are_encoded_by_the_dp(tok: PlamoTokenizerNative) -> None:
    assert tok("<|plamo:op|>", add_special_tokens=False)["input_ids"] == [4]


def test_add_special_tokens_flags_and_attributes(tok: PlamoTokenizerNative, tokdir: Path) -> None:
    body = tok("Tom had 250 stamps.", add_special_tokens=False)["input_ids"]
    assert 1 not in body and 2 not in body
    assert tok("Tom had 250 stamps.")["input_ids"] == [1, *body]
    plain = PlamoTokenizerNative(str(tokdir / "tokenizer.jsonl"))  # no config: PLaMo's defaults
    assert not plain.add_bos_token and plain("Tom had 250 stamps.")["input_ids"] == body
    both = PlamoTokenizerNative(str(tokdir / "tokenizer.jsonl"), add_bos_token=True, add_eos_token=True)
    assert both("Tom had 250 stamps.")["input_ids"] == [1, *body, 2]
    assert both("Tom had 250 stamps.", return_special_tokens_mask=True)["special_tokens_mask"] == [1] + [0] * len(
        body
    ) + [1]
    both.add_bos_token = False
    assert both("Tom had 250 stamps.")["input_ids"] == [*body, 2]


def test_batch_encoding_equals_one_by_one(tok: PlamoTokenizerNative) -> None:
    rng = random.Random(0)
    texts = TEXTS + [random_text(rng, rng.randint(0, 40)) for _ in range(20)]
    batch = tok(texts)["input_ids"]
    assert batch == [tok(t)["input_ids"] for t in texts]
    padded = tok(texts[:3], padding=True, return_tensors="pt")
    assert padded["input_ids"].shape[0] == 3 and int(padded["attention_mask"][0].sum()) == len(batch[0])


def test_tokenize_and_convert_agree_with_the_string_round_trip(tok: PlamoTokenizerNative) -> None:
    for text in TEXTS:
        tokens = tok.tokenize(text)
        assert tok.convert_tokens_to_ids(tokens) == [tok._convert_token_to_id_with_added_voc(t) for t in tokens]
        assert tok.convert_tokens_to_ids(list(tokens)) == tok.encode(text, add_special_tokens=False)
    tokens = tok.tokenize("Tom had 250 stamps.")
    tokens[0] = CONTROL_TOKENS[2]  # an edited list is converted token by token, not from stale ids
    assert tok.convert_tokens_to_ids(tokens)[0] == 2


@pytest.mark.parametrize("text", TEXTS)
def test_decode_inverts_encode(tok: PlamoTokenizerNative, text: str) -> None:
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == CONTROL_TOKENS[1] + text
    assert tok.decode(ids, skip_special_tokens=True) == text.replace(CONTROL_TOKENS[2], "").replace(
        CONTROL_TOKENS[1], ""
    )
    assert tok.decode(ids) == tok.convert_tokens_to_string(tok.convert_ids_to_tokens(ids))


def test_random_texts_round_trip(tok: PlamoTokenizerNative) -> None:
    rng = random.Random(1)
    for _ in range(50):
        text = random_text(rng, rng.randint(0, 60))
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_decode_bytes_and_broken_utf8(tok: PlamoTokenizerNative) -> None:
    byte = {b: 7 + b for b in range(256)}  # the synthetic byte rows follow the 7 control rows
    assert tok.decode([byte[0xE6], byte[0x97], byte[0xA5]]) == "日"
    assert tok.decode([byte[0xE6], byte[0x97]]) == "\ufffd"  # UTF-8 with replacement, as PLaMo
    assert tok.decode(byte[0x41]) == "A"


def test_ids_without_a_row_decode_to_nothing(tok: PlamoTokenizerNative) -> None:
    assert tok.decode([1100, 1199]) == ""
    assert tok.convert_ids_to_tokens(1150) == ""
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([1200])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([-1])


def test_added_tokens_work_like_transformers(tokdir: Path) -> None:
    tok = load_native(tokdir)
    tok.add_tokens(["<extra>"], special_tokens=True)
    new = tok.convert_tokens_to_ids("<extra>")
    assert new == 1100  # transformers puts it after the rows, as for PLaMo's own class
    assert tok("a<extra>b", add_special_tokens=False)["input_ids"][1] == new
    assert tok.decode([new]) == "<extra>" and tok.decode([new], skip_special_tokens=True) == ""


def test_save_and_reload(tok: PlamoTokenizerNative, tmp_path: Path) -> None:
    tok.save_pretrained(tmp_path)
    again = PlamoTokenizerNative.from_pretrained(str(tmp_path))
    assert (tmp_path / "tokenizer.jsonl").read_bytes() == Path(tok.vocab_file).read_bytes()
    for text in TEXTS:
        assert again(text, add_special_tokens=False)["input_ids"] == tok(text, add_special_tokens=False)["input_ids"]


def test_pickle_round_trip(tok: PlamoTokenizerNative) -> None:
    again = pickle.loads(pickle.dumps(tok))
    assert [again(t)["input_ids"] for t in TEXTS] == [tok(t)["input_ids"] for t in TEXTS]


def test_ids_go_through_the_added_tokens_like_plamos_string_round_trip(tokdir: Path) -> None:
    """PLaMo's class returns piece strings that transformers maps back through the added tokens
    first: a piece that is an added token under another id comes out with that id."""
    from transformers import AddedToken

    vocab = str(tokdir / "tokenizer.jsonl")
    moved = {9: AddedToken(CONTROL_TOKENS[4], special=True, normalized=False)}  # "<|plamo:op|>" is row 4
    for split in (False, True):
        tok = PlamoTokenizerNative(vocab, added_tokens_decoder=moved, split_special_tokens=split)
        assert tok(CONTROL_TOKENS[4] + "a", add_special_tokens=False)["input_ids"][0] == 9


def test_decode_kept_is_transformers_decode_with_specials_kept(tokdir: Path) -> None:
    """The runtime's fast path (issue 33) gives transformers' own text for vLLM's settings: random
    ids over the rows, the control tokens, an added special token and ids without a row.  Seen
    failing with clean-up on (`clean_up_tokenization_spaces=True` inside `decode_kept`)."""
    from plamo2_tools.runtime.batching.text import decode_kept_specials

    tok = load_native(tokdir)
    tok.add_tokens(["<extra>"], special_tokens=True)
    rng = random.Random(3)
    ids = [[rng.randrange(0, 1200) for _ in range(rng.randrange(1, 80))] for _ in range(400)]
    ids += [[tok.convert_tokens_to_ids("<extra>"), 5, 1, 2], [0, 1, 2, 3, 4], []]
    texts = [*TEXTS, "I do n't know . Really ? Yes , it 's"]  # what transformers' clean-up rewrites
    ids += [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    fast = decode_kept_specials(tok)
    for row in ids:
        want = tok.decode(
            row, skip_special_tokens=False, spaces_between_special_tokens=False, clean_up_tokenization_spaces=False
        )
        assert tok.decode_kept(row) == want and fast(row) == want, row
