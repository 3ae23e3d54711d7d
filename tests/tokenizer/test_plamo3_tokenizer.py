"""PLaMo 3 through transformers and the project: which directories get it, the thresholds from
tokenizer_config.json, transformers' added-token split before PLaMo 3's cuts, round trips, pickling
and saving, synth's PLaMo 3 tokenizer, `plamo2-tools tokenize` and the runtime's loader."""

from __future__ import annotations

import json
import pickle
import random
import shutil
from pathlib import Path

import pytest
from plamo3_reference import BOUNDARY, split_ids
from tokenizer_reference import Reference

from plamo2_tools.errors import UserError
from plamo2_tools.model.registry import tokenizer_flavour
from plamo2_tools.tokenizer import PlamoTokenizerNative, load_native, load_tokenizer, write_synthetic_tokenizer
from plamo2_tools.tokenizer.synthetic import CONTROL_TOKENS, PLAMO3_THRESHOLDS

SPECIALS = {CONTROL_TOKENS[i]: i for i in range(4)}  # what the synthetic config registers: unk, bos, eos, pad
REPEATED, SPACES = 16, 8  # synthetic.PLAMO3_THRESHOLDS, spelled out
TEXTS = [
    "",
    "Question: Tom had 250 stamps.\nAnswer: 250 - 75 = <<250-75=175>>175",
    "x<|plamo:op|>y and<|plamo:op|><|plamo:op|>z",
    "a<|plamo:xyz|>b<|plamo:eos|>c<|plamo:bos|>",
    "<|plamo:" + "ab" * 32 + "|>x<|plamo:" + "ab" * 32 + "a|>",
    "<|plamo:a b|> <|plamo:a|b|> <|plamo:<|plamo:op|>|> <|plamo:<|plamo:bos|>|>",
    "a\uee00b \uee00\uee00 東京\uee00大阪",
    "aaaaaaaaaaaaaaa|aaaaaaaaaaaaaaaa|aaaaaaaaaaaaaaaaa",  # 15, 16, 17
    "x       y        z         w",  # 7, 8, 9 spaces
    "ーーーーーーーーーーーーーーーー！" + "👍" * 17 + "\n" * 20,
    "<|plamo:" + "a" * 16 + "|>" + " " * 8 + "<|plamo:eos|>",
]


def rows_of(directory: Path) -> list[list[object]]:
    return [json.loads(line) for line in (directory / "tokenizer.jsonl").read_text(encoding="utf-8").splitlines()]


def expected_ids(rows: list[list[object]], text: str, repeated: int | None, spaces: int | None) -> list[int]:
    """transformers' split first (the registered special tokens by scanning), then the rule per piece."""
    reference = Reference(rows)
    out: list[int] = []
    start = i = 0
    while i <= len(text):
        special = next((s for s in SPECIALS if text.startswith(s, i)), None)
        if special is None and i < len(text):
            i += 1
            continue
        out += split_ids(reference, text[start:i], repeated, spaces)
        if special is None:
            break
        out.append(SPECIALS[special])
        i = start = i + len(special)
    return out


@pytest.fixture(scope="module")
def tokdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tok3")
    write_synthetic_tokenizer(directory, vocab_size=1200, flavour="plamo3")
    (directory / "config.json").write_text(json.dumps({"vocab_size": 1216}))  # no model_type: the config decides
    return directory


@pytest.fixture(scope="module")
def tok(tokdir: Path) -> PlamoTokenizerNative:
    return load_native(tokdir)


def variant(tokdir: Path, target: Path, config: dict[str, object] | None = None, **changes: object) -> Path:
    """A copy of the PLaMo 3 directory with tokenizer_config.json keys changed (None removes one)."""
    target.mkdir()
    shutil.copy(tokdir / "tokenizer.jsonl", target)
    settings = json.loads((tokdir / "tokenizer_config.json").read_text())
    settings.update(changes)
    settings = {k: v for k, v in settings.items() if v is not None}
    (target / "tokenizer_config.json").write_text(json.dumps(settings))
    if config is not None:
        (target / "config.json").write_text(json.dumps(config))
    return target


# ---- which directories are PLaMo 3 -------------------------------------------------------------------
def test_synthetic_plamo3_config(tokdir: Path, tmp_path: Path) -> None:
    settings = json.loads((tokdir / "tokenizer_config.json").read_text())
    assert settings["tokenizer_class"] == "Plamo3Tokenizer"
    assert settings["auto_map"] == {"AutoTokenizer": ["tokenization_plamo.Plamo3Tokenizer", None]}
    assert PLAMO3_THRESHOLDS == {
        "break_around_repeated_chars_threshold": REPEATED,
        "break_around_consecutive_spaces_threshold": SPACES,
    }
    assert {k: settings[k] for k in PLAMO3_THRESHOLDS} == PLAMO3_THRESHOLDS
    write_synthetic_tokenizer(tmp_path, vocab_size=1200)
    plamo2 = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert plamo2["tokenizer_class"] == "Plamo2Tokenizer" and not set(PLAMO3_THRESHOLDS) & set(plamo2)
    assert {k: v for k, v in settings.items() if k not in PLAMO3_THRESHOLDS} == plamo2 | {
        "tokenizer_class": "Plamo3Tokenizer",
        "auto_map": settings["auto_map"],
    }
    assert rows_of(tmp_path) == rows_of(tokdir)  # the same file for both families


def test_loaded_with_plamos_constructor_arguments(tok: PlamoTokenizerNative) -> None:
    assert tok.plamo_family == "plamo3"
    assert tok.break_around_repeated_chars_threshold == REPEATED
    assert tok.break_around_consecutive_spaces_threshold == SPACES
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2, 3)
    assert tok.add_bos_token and not tok.add_eos_token and tok.model_vocab_size == 1216


@pytest.mark.parametrize(
    ("changes", "config", "family"),
    [
        ({}, None, "plamo3"),
        ({"auto_map": None}, None, "plamo3"),  # tokenizer_class alone
        ({"tokenizer_class": None}, None, "plamo3"),  # auto_map alone
        ({"tokenizer_class": None, "auto_map": None}, None, "plamo2"),
        ({"tokenizer_class": None, "auto_map": None}, {"model_type": "plamo3"}, "plamo3"),
        ({"tokenizer_class": "PreTrainedTokenizer", "auto_map": None}, {"model_type": "plamo3"}, "plamo3"),
        ({"tokenizer_class": "Plamo2Tokenizer", "auto_map": None}, {"model_type": "plamo3"}, "plamo2"),
        ({"tokenizer_class": None, "auto_map": None}, {"model_type": "plamo2"}, "plamo2"),
        ({"auto_map": {"AutoTokenizer": ["tokenization_plamo.Plamo2Tokenizer", None]}}, None, "plamo2"),
    ],
)
def test_family_detection(
    tokdir: Path, tmp_path: Path, changes: dict[str, object], config: dict[str, object] | None, family: str
) -> None:
    """The class tokenizer_config.json names wins; naming none, the flavour the model family of the
    directory's config.json declares (`Family.tokenizer_flavour`, as the runtime loads it)."""
    directory = variant(tokdir, tmp_path / "v", config, **changes)
    tok = load_tokenizer(directory, flavour=tokenizer_flavour(directory))
    assert isinstance(tok, PlamoTokenizerNative) and tok.plamo_family == family
    text = "x<|plamo:op|>y" + "a" * 20
    expected = [1] + (expected_ids(rows_of(tokdir), text, REPEATED, SPACES) if family == "plamo3" else [])
    if family == "plamo2":
        expected += Reference(rows_of(tokdir)).plain_dp(text)
    assert tok(text)["input_ids"] == expected


def test_explicit_family(tokdir: Path) -> None:
    vocab = str(tokdir / "tokenizer.jsonl")
    assert PlamoTokenizerNative(vocab).plamo_family == "plamo3"  # found from the file's directory
    assert PlamoTokenizerNative(vocab).break_around_repeated_chars_threshold is None  # not read from the config
    assert PlamoTokenizerNative(vocab, plamo_family="plamo2").plamo_family == "plamo2"
    with pytest.raises(ValueError, match="plamo_family"):
        PlamoTokenizerNative(vocab, plamo_family="plamo4")


# ---- ids ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", TEXTS)
def test_ids_are_transformers_split_then_plamo3_cuts(tok: PlamoTokenizerNative, tokdir: Path, text: str) -> None:
    expected = expected_ids(rows_of(tokdir), text, REPEATED, SPACES)
    assert tok(text)["input_ids"] == [1, *expected]
    assert tok.encode(text, add_special_tokens=False) == expected
    assert tok.convert_tokens_to_ids(tok.tokenize(text)) == expected
    # Nothing split out first: the whole text meets the cuts (the registered tokens are 0-score pieces).
    whole = split_ids(Reference(rows_of(tokdir)), text, REPEATED, SPACES)
    assert tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"] == whole


@pytest.mark.parametrize(("repeated", "spaces"), [(None, None), (2, None), (None, 1), (3, 2), (1, 1)])
def test_thresholds_come_from_the_config(
    tokdir: Path, tmp_path: Path, repeated: int | None, spaces: int | None
) -> None:
    names = list(PLAMO3_THRESHOLDS)
    directory = variant(tokdir, tmp_path / "v", **{names[0]: repeated, names[1]: spaces})
    tok = load_tokenizer(directory)
    assert (tok.break_around_repeated_chars_threshold, tok.break_around_consecutive_spaces_threshold) == (
        repeated,
        spaces,
    )
    for text in TEXTS:
        assert tok(text, add_special_tokens=False)["input_ids"] == expected_ids(rows_of(tokdir), text, repeated, spaces)


def test_added_token_stripping_happens_before_the_cuts(tokdir: Path) -> None:
    """transformers strips around an lstrip/rstrip added token before PLaMo 3 sees the text; were
    the boundaries inserted first, the stripped spaces would sit behind a U+EE00 and stay."""
    from transformers import AddedToken

    tok = load_native(tokdir)
    tok.add_tokens([AddedToken("<|plamo:mine|>", lstrip=True, rstrip=True, normalized=False)])
    mine = tok.convert_tokens_to_ids("<|plamo:mine|>")
    rows = rows_of(tokdir)
    got = tok("a   <|plamo:mine|>   b", add_special_tokens=False)["input_ids"]
    assert got == [*expected_ids(rows, "a", REPEATED, SPACES), mine, *expected_ids(rows, "b", REPEATED, SPACES)]


def test_round_trips(tok: PlamoTokenizerNative) -> None:
    rng = random.Random(7)
    alphabet = ["a", " ", "<|plamo:", "|>", "op", "<|plamo:op|>", "\uee00", "日", "👍", "\n", "é", "a" * 16, " " * 8]
    texts = TEXTS + ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 25))) for _ in range(60)]
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert 10_000_000 not in ids and all(0 <= i < len(tok) for i in ids)
        assert tok.decode(ids) == text.replace(BOUNDARY, "")
    assert tok(texts)["input_ids"] == [tok(t)["input_ids"] for t in texts]


def test_pickle_and_save_keep_plamo3(tok: PlamoTokenizerNative, tmp_path: Path) -> None:
    again = pickle.loads(pickle.dumps(tok))
    assert [again(t)["input_ids"] for t in TEXTS] == [tok(t)["input_ids"] for t in TEXTS]
    tok.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert {k: saved[k] for k in PLAMO3_THRESHOLDS} == PLAMO3_THRESHOLDS
    reloaded = load_tokenizer(tmp_path)
    assert reloaded.plamo_family == "plamo3"
    body = [tok.encode(t, add_special_tokens=False) for t in TEXTS]  # (transformers does not save add_bos_token)
    assert [reloaded.encode(t, add_special_tokens=False) for t in TEXTS] == body


def test_plamo2_directory_of_the_same_rows_has_no_cuts(tokdir: Path, tmp_path: Path) -> None:
    write_synthetic_tokenizer(tmp_path, vocab_size=1200)
    tok = load_tokenizer(tmp_path)
    assert tok.plamo_family == "plamo2" and not hasattr(tok, "break_around_repeated_chars_threshold")
    reference = Reference(rows_of(tmp_path))
    for text in ["x<|plamo:op|>y", "a\uee00b", "a" * 20 + " " * 10 + "b"]:
        assert tok(text, add_special_tokens=False)["input_ids"] == reference.plain_dp(text)


def test_bad_threshold_is_a_user_error(tokdir: Path, tmp_path: Path) -> None:
    directory = variant(tokdir, tmp_path / "v", break_around_repeated_chars_threshold="16")
    with pytest.raises(UserError, match="cannot load the PLaMo tokenizer"):
        load_tokenizer(directory)  # PLaMo's own class fails the same way: "16" - 1


# ---- synth, the CLI and the runtime ------------------------------------------------------------------
@pytest.fixture(scope="module")
def synth3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from plamo2_tools.model.synth import synth

    out = tmp_path_factory.mktemp("synth") / "tiny3"
    synth(out, "tiny3")
    return out


def test_synth_writes_plamo3_tokenizers_for_plamo3_presets(synth3: Path, tmp_path: Path) -> None:
    from plamo2_tools.model.synth import synth

    settings = json.loads((synth3 / "tokenizer_config.json").read_text())
    assert settings["tokenizer_class"] == "Plamo3Tokenizer"
    assert {k: settings[k] for k in PLAMO3_THRESHOLDS} == PLAMO3_THRESHOLDS
    assert load_tokenizer(synth3).plamo_family == "plamo3"
    synth(tmp_path / "tiny", "tiny")
    settings = json.loads((tmp_path / "tiny" / "tokenizer_config.json").read_text())
    assert (
        settings["tokenizer_class"] == "Plamo2Tokenizer" and load_tokenizer(tmp_path / "tiny").plamo_family == "plamo2"
    )


def test_tokenize_command_and_runtime_loader(cli, synth3: Path) -> None:
    from plamo2_tools.runtime.batching.engine import load_tokenizer as engine_load

    tok = engine_load(synth3)  # what generate, eval and verify use
    assert isinstance(tok, PlamoTokenizerNative) and tok.plamo_family == "plamo3"
    stdin = "".join(json.dumps(t, ensure_ascii=False) + "\n" for t in TEXTS if t)
    lines = cli("tokenize", str(synth3), input=stdin).stdout.splitlines()
    assert [json.loads(line) for line in lines] == [tok(t)["input_ids"] for t in TEXTS if t]
    expected = [1, *expected_ids(rows_of(synth3), TEXTS[2], REPEATED, SPACES)]
    assert json.loads(lines[1]) == expected


def test_trust_remote_code_still_asks_for_the_checkpoints_own_code(synth3: Path) -> None:
    with pytest.raises(UserError, match="cannot load the tokenizer"):
        load_tokenizer(synth3, trust_remote_code=True)  # names tokenization_plamo.Plamo3Tokenizer, ships no code
