"""Issue 14 for the commands that run the model (generate, verify, eval, logits): damaged shards
refused at load, options checked before any work, and the one error path's words: each case
through the real CLI, with its exit code and exactly one line on stderr."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from plamo2_tools import __version__
from plamo2_tools.runtime.batching import engine

MINI_GSM8K = Path(__file__).parents[1] / "eval" / "data" / "gsm8k_mini"
EVAL = (
    "--tasks",
    "gsm8k",
    "--gsm8k-dir",
    MINI_GSM8K,
    "--allow-unverified-data",
    "--limit",
    "1",
    "--num-fewshot",
    "0",
    "--max-gen-toks",
    "4",
    "--bootstrap-iters",
    "0",
)


@pytest.fixture(scope="module")
def layout(shards) -> Path:
    """The runtime tests' tiny model (tests/runtime/conftest.py) at TP 2."""
    return shards("tiny", 2, 1, seed=11)


@pytest.fixture
def damaged(layout: Path, tmp_path: Path):
    """A private copy of the tp=2 shards, damaged one way."""

    def make(how: str) -> Path:
        out = tmp_path / how
        shutil.copytree(layout, out)
        rank0 = out / "model-rank-0-part-0.safetensors"
        if how == "swapped":  # rank 1's file under rank 0's name: same keys, shapes and size
            shutil.copyfile(out / "model-rank-1-part-0.safetensors", rank0)
        elif how == "flipped":
            data = bytearray(rank0.read_bytes())
            data[-100] ^= 0xFF
            rank0.write_bytes(bytes(data))
        elif how == "truncated":
            with open(rank0, "r+b") as f:
                f.truncate(rank0.stat().st_size - 64)
        return out

    return make


def _commands(shards: Path, reference: Path, tmp_path: Path) -> dict[str, tuple]:
    return {
        "generate": ("generate", shards, "--prompt", "hello", "--max-new-tokens", "2"),
        "verify": ("verify", shards, "--reference", reference, "--max-new-tokens", "2"),
        "eval": ("eval", shards, *EVAL, "--output-path", tmp_path / "eval-out"),
    }


# ---- shards verified when loaded ------------------------------------------------------------------
@pytest.mark.parametrize("how", ["swapped", "flipped", "truncated"])
def test_damaged_shards_are_refused_by_every_runner(
    cli, one_line_error, checkpoint, damaged, tmp_path: Path, how: str
) -> None:
    shards = damaged(how)
    words = {
        "swapped": "header says tp_rank=1, expected 0 (another rank's file?)",
        "flipped": "model-rank-0-part-0.safetensors: xxh3-128 digest differs from the manifest",
        "truncated": "(truncated or replaced)",
    }[how]
    for name, args in _commands(shards, checkpoint("tiny", seed=11), tmp_path).items():
        line = one_line_error(cli(*args, expect=2), 2)
        assert words in line, (name, line)
    assert not (tmp_path / "eval-out").exists()


def test_no_verify_skips_only_the_digests(cli, one_line_error, damaged) -> None:
    """The escape hatch for users who just ran `check`: the digest is not computed (a flipped
    payload byte runs), the header checks still stand (a swapped file does not)."""
    cli("generate", damaged("flipped"), "--prompt", "hello", "--max-new-tokens", "2", "--no-verify", "--json")
    swapped = damaged("swapped")
    line = one_line_error(cli("generate", swapped, "--prompt", "x", "--no-verify", expect=2), 2)
    assert "another rank's file" in line


# ---- options checked up front ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "code", "words"),
    [
        (("--temperature", "-1"), 2, "--temperature -1: must be >= 0"),
        (("--top-p", "2"), 2, "--top-p 2: must be in (0, 1]"),
        (("--top-p", "0"), 2, "--top-p 0: must be in (0, 1]"),
        (("--max-new-tokens", "0"), 2, "--max-new-tokens 0: must be >= 1"),
        (("--max-new-tokens", str(20 * 2**20)), 2, "exceed the model's limit of"),
        (("--backend", "foo"), 2, "--backend 'foo' is not a kernel backend"),
        (("--device", "xpu"), 2, "the runtime runs on cpu or cuda, not xpu"),
        (("--device", "tpu"), 2, "--device 'tpu' is not a device"),
        (("--max-new-tokens", "x"), 2, "Invalid value for '--max-new-tokens'"),
    ],
)
def test_generate_options(cli, one_line_error, layout: Path, args: tuple, code: int, words: str) -> None:
    assert words in one_line_error(cli("generate", layout, "--prompt", "hello", *args, expect=code), code)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu(cli, one_line_error, layout: Path, checkpoint, tmp_path: Path) -> None:
    for args in (
        ("generate", layout, "--prompt", "x", "--device", "cuda"),
        ("logits", layout, "--input-ids", "1,2", "--out", tmp_path / "x.npy", "--device", "cuda"),
        ("verify", layout, "--reference", checkpoint("tiny", seed=11), "--reference-device", "cuda"),
        ("eval", layout, *EVAL, "--device", "cuda"),
    ):
        line = one_line_error(cli(*args, expect=3), 3)
        assert "cuda: no CUDA device is usable (" in line, line


def test_triton_on_the_cpu(cli, one_line_error, layout: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the test session sets it for the kernel tests
    line = one_line_error(cli("generate", layout, "--prompt", "x", "--backend", "triton", expect=2), 2)
    assert "--backend triton runs on CUDA devices" in line


def test_output_files_checked_before_the_work(
    cli, one_line_error, layout: Path, checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_work(*args, **kwargs):
        raise AssertionError("the work started before the output was checked")

    monkeypatch.setattr(engine.Runtime, "prompt_logits", no_work)
    line = one_line_error(cli("logits", layout, "--input-ids", "1,2", "--out", tmp_path / "no" / "x.npy", expect=2), 2)
    assert "the directory" in line and "does not exist" in line
    line = one_line_error(cli("logits", layout, "--input-ids", "1,999999999", "--out", tmp_path / "x.npy", expect=2), 2)
    assert "outside the vocabulary" in line
    args = ("verify", layout, "--reference", checkpoint("tiny", seed=11))
    assert "no such file" in one_line_error(cli(*args, "--prompts", tmp_path / "missing.txt", expect=2), 2)
    assert "does not exist" in one_line_error(cli(*args, "--output", tmp_path / "no" / "v.json", expect=2), 2)
    monkeypatch.undo()
    cli("logits", layout, "--input-ids", "1,2", "--out", tmp_path / "logits")  # written exactly there
    assert (tmp_path / "logits").exists() and not (tmp_path / "logits.npy").exists()


def test_eval_inputs(cli, one_line_error, layout: Path, tmp_path: Path) -> None:
    data = tmp_path / "gsm8k"
    data.mkdir()
    shutil.copy(MINI_GSM8K / "train.jsonl", data / "train.jsonl")
    (data / "test.jsonl").write_text('{"question": "1+1?", "answer": "#### 2"}\nthis is not JSON\n')
    line = one_line_error(cli("eval", layout, "--gsm8k-dir", data, "--allow-unverified-data", expect=2), 2)
    assert "test.jsonl: line 2 is not JSON" in line
    (data / "test.jsonl").write_text('{"question": "1+1?"}\n')
    line = one_line_error(cli("eval", layout, "--gsm8k-dir", data, "--allow-unverified-data", expect=2), 2)
    assert 'line 1 is not a GSM8K record (needs "question" and "answer" strings)' in line
    for args, words in (
        (("--batch-size", "0"), "--batch-size 0"),
        (("--max-gen-toks", "0"), "--max-gen-toks 0"),
        (("--limit", "-1"), "--limit must be > 0"),
        (("--backend", "x"), "--backend 'x'"),
    ):
        assert words in one_line_error(cli("eval", layout, *EVAL[:5], *args, expect=2), 2)


def test_gsm8k_task_command_writes_the_yaml(cli, one_line_error, tmp_path: Path) -> None:
    out = tmp_path / "tasks"
    cli("gsm8k-task", out, "--gsm8k-dir", MINI_GSM8K, "--allow-unverified-data")
    text = (out / "gsm8k.yaml").read_text()
    assert "Written by plamo2-tools" in text and str(MINI_GSM8K / "test.jsonl") in text
    cli("gsm8k-task", out, "--gsm8k-dir", MINI_GSM8K, "--allow-unverified-data")  # its own file: rewritten
    (out / "gsm8k.yaml").write_text("task: mine\n")
    line = one_line_error(cli("gsm8k-task", out, "--gsm8k-dir", MINI_GSM8K, "--allow-unverified-data", expect=2), 2)
    assert "was not written by plamo2-tools" in line and (out / "gsm8k.yaml").read_text() == "task: mine\n"


# ---- the one error path -------------------------------------------------------------------------------
def test_version_and_usage_errors(cli, one_line_error) -> None:
    assert cli("--version").stdout.strip() == __version__
    assert "No such command 'nope'" in one_line_error(cli("nope", expect=2), 2)
    assert "Missing argument" in one_line_error(cli("convert", expect=2), 2)


def test_interrupts_say_what_is_left(cli, one_line_error, interrupt, layout: Path, checkpoint) -> None:
    interrupt(engine.Runtime, "generate")
    line = one_line_error(cli("generate", layout, "--prompt", "x", expect=130), 130, prefix="interrupted:")
    assert line == "interrupted: nothing was written", line
    r = cli("verify", layout, "--reference", checkpoint("tiny", seed=11), expect=130)  # after the reference: its bar
    assert r.stderr.splitlines()[-1] == "interrupted: nothing was written" and "Traceback" not in r.stderr


def test_a_bug_says_it_is_one(cli, layout: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The only traceback a user ever sees: a bug's, then one line saying so and where to report."""

    def broken(*args, **kwargs):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(engine.Runtime, "generate", broken)
    r = cli("generate", layout, "--prompt", "x", expect=70)
    assert "Traceback" in r.stderr and "ZeroDivisionError: a bug" in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("bug: plamo2-tools") and "this is a bug in plamo2-tools" in last and "report" in last
