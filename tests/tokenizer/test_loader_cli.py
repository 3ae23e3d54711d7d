"""Which tokenizer a directory gets, the runtime's use of it, and `plamo2-tools tokenize`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plamo2_tools.errors import UserError
from plamo2_tools.tokenizer import PlamoTokenizerNative, load_tokenizer, write_synthetic_tokenizer


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("ckpt")
    write_synthetic_tokenizer(directory, vocab_size=700)
    (directory / "config.json").write_text(json.dumps({"vocab_size": 768}))
    return directory


def byte_level_dir(directory: Path) -> Path:
    """A tokenizer.json directory (no tokenizer.jsonl): AutoTokenizer's business."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {chr(c): i for i, c in enumerate(range(ord("a"), ord("z") + 1))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "a"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def test_plamo_vocabulary_loads_natively(ckpt: Path) -> None:
    tok = load_tokenizer(ckpt)
    assert isinstance(tok, PlamoTokenizerNative)
    assert tok.model_vocab_size == 768 and tok.add_bos_token


def test_other_directories_go_to_autotokenizer(tmp_path: Path) -> None:
    tok = load_tokenizer(byte_level_dir(tmp_path / "fast"))
    assert not isinstance(tok, PlamoTokenizerNative)
    assert tok("abc", add_special_tokens=False)["input_ids"] == [0, 1, 2]


def test_trust_remote_code_asks_for_the_checkpoints_own_code(ckpt: Path) -> None:
    # The synthetic directory names tokenization_plamo.Plamo2Tokenizer but ships no code for it.
    with pytest.raises(UserError, match="cannot load the tokenizer"):
        load_tokenizer(ckpt, trust_remote_code=True)


def test_missing_directory_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="not a directory"):
        load_tokenizer(tmp_path / "nowhere")


def test_runtime_engine_delegates(ckpt: Path) -> None:
    from plamo2_tools.runtime.batching.engine import load_tokenizer as engine_load

    assert isinstance(engine_load(ckpt), PlamoTokenizerNative)


# ---- plamo2-tools tokenize -----------------------------------------------------------------------
def run(cli, args: list[str], stdin: str | None = None, expect: int = 0) -> str:
    """`plamo2-tools tokenize ARGS` (the `cli` fixture: exit code `expect`, no uncaught exception):
    stdout on success, stderr otherwise."""
    result = cli("tokenize", *args, input=stdin, expect=expect)
    return result.stdout if expect == 0 else result.stderr


def test_encode_stdin_lines(cli, ckpt: Path) -> None:
    tok = load_tokenizer(ckpt)
    texts = ["Tom had 250 stamps.", "", "日本語\n2行目", "a<|plamo:eos|>b"]
    stdin = "".join(json.dumps(t, ensure_ascii=False) + "\n" for t in texts) + "\n   \n"
    lines = run(cli, [str(ckpt)], stdin).splitlines()
    assert [json.loads(line) for line in lines] == [tok(t)["input_ids"] for t in texts]
    assert json.loads(lines[0])[0] == 1  # BOS, as the config says


def test_files_and_decode(cli, ckpt: Path, tmp_path: Path) -> None:
    texts = ["Question: 1+1?", "東京 👍🏽"]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(t) + "\n" for t in texts))
    assert run(cli, [str(ckpt), "--input", str(tmp_path / "in.jsonl"), "--out", str(tmp_path / "ids.jsonl")]) == ""
    assert not (tmp_path / "ids.jsonl.partial").exists()
    run(cli, [str(ckpt), "--decode", "--input", str(tmp_path / "ids.jsonl"), "--out", str(tmp_path / "back.jsonl")])
    back = [json.loads(line) for line in (tmp_path / "back.jsonl").read_text().splitlines()]
    assert back == ["<|plamo:bos|>" + t for t in texts]
    out = run(cli, [str(ckpt), "--decode", "--skip-special-tokens", "--input", str(tmp_path / "ids.jsonl")])
    assert [json.loads(line) for line in out.splitlines()] == texts


@pytest.mark.parametrize(
    ("args", "stdin", "message"),
    [
        ([], "not json\n", "stdin:1: not JSON"),
        ([], '"ok"\n[1, 2]\n', "stdin:2: expected a string"),
        (["--decode"], '[1, "x"]\n', "expected an array of token ids"),
        (["--decode"], "[999999]\n", "cannot decode"),
        (["--input", "/nonexistent/in.jsonl"], None, "cannot read"),
    ],
)
def test_bad_input_exits_2(cli, ckpt: Path, args: list[str], stdin: str | None, message: str) -> None:
    assert message in run(cli, [str(ckpt), *args], stdin, expect=2)


def test_no_remote_code_without_the_flag(cli, tmp_path: Path) -> None:
    directory = tmp_path / "remote"
    write_synthetic_tokenizer(directory, vocab_size=300)
    (directory / "tokenizer.jsonl").rename(directory / "other.jsonl")  # not ours: AutoTokenizer's
    assert "remote code" in run(cli, [str(directory)], '"x"\n', expect=2)


# ---- tokenize --decode: one test per rule of a line (issue 34, class 4) ---------------------------------------
@pytest.mark.parametrize(
    ("stdin", "message"),
    [
        ("[true]\n", "stdin:1: expected an array of token ids"),  # JSON's true is no token id (Python: int 1)
        ("[5, false]\n", "stdin:1: expected an array of token ids"),
        ("[5, 6.0]\n", "stdin:1: expected an array of token ids"),
        ('"5"\n', "stdin:1: expected an array of token ids"),
        ("[[5]]\n", "stdin:1: expected an array of token ids"),
        ('{"ids": [5]}\n', "stdin:1: expected an array of token ids"),
        ("[5]\n\n[-1]\n", "stdin:3: cannot decode"),  # negative: not Python's index from the end
        ("[5]\n[768]\n", "stdin:2: cannot decode"),  # past the model's vocabulary
        ("[" * 5000 + "]" * 5000 + "\n", "stdin:1: nested too deeply"),
    ],
)
def test_decode_refuses_what_is_no_token_id(cli, one_line_error, ckpt: Path, stdin: str, message: str) -> None:
    """Each refusal is one line, exit 2, nothing on stdout for the refused line.  Seen red with the bool check
    of `tokenizer/cli_io.py` removed (`[true]` decoded as BOS; bench/mutants.py `valid-decode-bool`)."""
    r = cli("tokenize", str(ckpt), "--decode", input=stdin, expect=2)
    assert message in one_line_error(r, 2)


def test_decode_accepts_the_edges_of_the_vocabulary(cli, ckpt: Path) -> None:
    out = run(cli, [str(ckpt), "--decode"], "[0]\n[767]\n[]\n")
    assert len(out.splitlines()) == 3
