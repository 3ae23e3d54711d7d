"""`plamo2-tools generate SHARDS --input requests.jsonl --output results.jsonl`: every line through
one continuous-batching loop, each result equal to that request run alone (in-process runtime,
one `generate` call each); malformed lines reported by number while the rest runs, or refused up
front with --strict; a run killed mid-way and resumed leaves the file a clean run leaves."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from real_serve import ROOT, Oracle

from plamo2_tools.serve.batch import line_seed

LINES: list[Any] = [
    "Hello world",  # a plain-text line: the prompt
    {"prompt": "The cat sat on", "max_tokens": 7},
    {"prompt": [1, 17, 200, 33], "max_tokens": 5, "temperature": 0.8, "seed": 9},
    {"prompt": "bad", "max_tokens": "x"},  # malformed: a string for an integer
    "{not json",  # malformed: meant as JSON
    {"prompt": "Once", "max_tokens": 6, "temperature": 1.0},  # sampled, no seed: one from --seed and the line
    {"prompt": ["a", "b c"], "max_tokens": 4, "n": 2, "temperature": 0.7, "seed": 1},
    {"prompt": "日本語", "max_tokens": 30, "stop": ["\n"]},
]


@pytest.fixture(scope="module")
def shard_dir(shards) -> Path:  # type: ignore[no-untyped-def]
    return shards("tiny", 1, 1, seed=3)


@pytest.fixture(scope="module")
def oracle(shard_dir: Path) -> Iterator[Oracle]:
    o = Oracle(shard_dir)
    yield o
    o.close()


def write_lines(path: Path, lines: list[Any]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x, ensure_ascii=False)) + "\n" for x in lines))
    return path


def records(path: Path) -> list[dict[str, Any]]:
    """The results, after the file's first line (the run's header)."""
    header, *lines = path.read_text().splitlines()
    assert json.loads(header)["format"] == "plamo2-batch-results"
    return [json.loads(line) for line in lines]


def test_results_equal_each_request_alone(cli, shard_dir: Path, oracle: Oracle, tmp_path: Path) -> None:
    src = write_lines(tmp_path / "in.jsonl", LINES[:3] + [""] + LINES[3:])  # a blank line is skipped, still counted
    out = tmp_path / "out.jsonl"
    r = cli(
        "generate",
        shard_dir,
        "--input",
        src,
        "--output",
        out,
        "--max-new-tokens",
        "12",
        "--max-batch",
        "3",
        "--seed",
        "5",
        expect=2,
    )
    assert "line 5: max_tokens" in r.stderr and "line 6: not valid JSON" in r.stderr  # reported by number
    assert "2 of 8 input lines were refused (line(s) 5, 6)" in r.stderr
    got = records(out)
    assert [g["index"] for g in got] == [0, 1, 2, 4, 5, 6, 7, 8]  # 0-based line numbers, in order, blank skipped
    by = {g["index"]: g for g in got}
    assert by[4]["error"]["line"] == 5 and by[5]["error"]["line"] == 6

    def alone(
        prompt: Any, max_tokens: int, temperature: float = 0.0, seed: int = 0, key: int = 0, stop: tuple[str, ...] = ()
    ) -> tuple[str, list[int], str]:
        ids = oracle.ids(prompt) if isinstance(prompt, str) else prompt
        tokens = oracle.tokens(ids, max_tokens, temperature=temperature, seed=seed, key=key)
        text, finish = oracle.text(tokens, stop)
        return text, tokens, finish

    def choice(record: dict[str, Any], k: int = 0) -> tuple[str, list[int], str]:
        c = record["choices"][k]
        return c["text"], c["token_ids"], c["finish_reason"]

    assert choice(by[0]) == alone("Hello world", 12)  # --max-new-tokens is the default
    assert choice(by[1]) == alone("The cat sat on", 7)
    assert choice(by[2]) == alone([1, 17, 200, 33], 5, 0.8, seed=9)
    assert choice(by[6]) == alone("Once", 6, 1.0, seed=line_seed(5, 6))
    # n=2 over two prompts: choice index = prompt * n + k, choice k drawing from stream k
    assert [choice(by[7], i) for i in range(4)] == [
        alone(p, 4, 0.7, seed=1, key=k) for p in ("a", "b c") for k in (0, 1)
    ]
    text, tokens, _ = alone("日本語", 30, stop=("\n",))
    assert by[8]["choices"][0]["text"] == text
    assert by[8]["usage"]["prompt_tokens"] == len(oracle.ids("日本語"))

    # run again: everything that ran is done and skipped; the file does not change
    before = out.read_bytes()
    r = cli("generate", shard_dir, "--input", src, "--output", out, "--max-new-tokens", "12", "--seed", "5", expect=2)
    assert "resuming: 6 requests already done" in r.stderr and "0 requests run" in r.stderr
    assert out.read_bytes() == before


def test_strict_refuses_up_front(cli, one_line_error, shard_dir: Path, tmp_path: Path) -> None:
    src = write_lines(tmp_path / "in.jsonl", LINES)
    out = tmp_path / "out.jsonl"
    line = one_line_error(cli("generate", shard_dir, "--input", src, "--output", out, "--strict", expect=2), 2)
    assert "line 4: max_tokens" in line and "(and 1 more line(s))" in line
    assert not out.exists()
    for args, words in (
        (("--input", src), "--output"),
        (("--input", src, "--output", src), "must not be"),
        (("--input", tmp_path / "none.jsonl", "--output", out), "no such file"),
        (("--prompt", "x", "--input", src), "either --prompt"),
    ):
        assert words in one_line_error(cli("generate", shard_dir, *args, expect=2), 2)


def generate_process(shard_dir: Path, src: Path, out: Path) -> subprocess.Popen[str]:
    cmd = [
        sys.executable,
        "-m",
        "plamo2_tools.cli",
        "generate",
        str(shard_dir),
        "--input",
        str(src),
        "--output",
        str(out),
        "--max-batch",
        "2",
        "--max-new-tokens",
        "40",
        "--seed",
        "3",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    # SIGINT at its default, as a terminal's Ctrl-C finds a foreground process: the test sends one, and a
    # test run launched in the background would otherwise hand the CLI an ignored SIGINT.
    return subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


@pytest.mark.slow
def test_killed_and_resumed_equals_a_clean_run(shard_dir: Path, tmp_path: Path) -> None:
    lines: list[Any] = [{"prompt": [1, 5 + i, 9 + i], "max_tokens": 20 + i % 21} for i in range(36)]
    lines[7] = {"prompt": "sampled", "temperature": 0.9}  # seed from --seed and the line
    lines[11] = "{broken"
    src = write_lines(tmp_path / "in.jsonl", lines)

    clean = tmp_path / "clean.jsonl"
    p = generate_process(shard_dir, src, clean)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 2 and "line 12: not valid JSON" in err, err

    out = tmp_path / "resumed.jsonl"
    p = generate_process(shard_dir, src, out)
    deadline = time.monotonic() + 120
    while not (out.exists() and len(out.read_text().splitlines()) >= 4):
        assert p.poll() is None and time.monotonic() < deadline, "the run ended before it could be killed"
        time.sleep(0.01)
    p.send_signal(signal.SIGKILL)
    p.wait(30)
    partial = out.read_text().splitlines()[1:]  # after the header
    assert 3 <= len(partial) < 35, len(partial)  # killed mid-run: some results written, not all
    with open(out, "a") as f:
        f.write('{"index": 30, "choi')  # as if killed mid-write: a cut last line is dropped on resume

    # resumed, then Ctrl-C (SIGINT): exit 130 with one line saying what is left, soon, no hang
    p = generate_process(shard_dir, src, out)
    while len(out.read_text().splitlines()) < 1 + len(partial) + 3:
        assert p.poll() is None and time.monotonic() < deadline + 120, "the resumed run ended before the SIGINT"
        time.sleep(0.01)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert f"resuming: {len(partial)} requests already done" in err  # the cut line did not count
    assert err.strip().splitlines()[-1] == (
        f"interrupted: {out} holds the results finished so far; run the same command again to resume"
    )
    before = len(out.read_text().splitlines()) - 1

    p = generate_process(shard_dir, src, out)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 2, err
    assert f"resuming: {before} requests already done" in err
    assert out.read_bytes() == clean.read_bytes()
    assert len(records(clean)) == 36
