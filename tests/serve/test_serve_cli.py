"""`plamo2-tools serve` refuses bad input with one line before it loads the model (issue 14's
contract: exit 2 for bad input, 3 for what the environment refuses, no traceback)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def shard_dir(shards) -> Path:  # type: ignore[no-untyped-def]
    return shards("tiny", 1, 1, seed=3)


@pytest.mark.parametrize(
    "args,words",
    [
        (("--port", "70000"), "--port 70000"),
        (("--max-batch", "0"), "--max-batch 0"),
        (("--max-batch", "lots"), "lots"),
        (("--max-queue", "-1"), "--max-queue -1"),
        (("--max-body-bytes", "0"), "--max-body-bytes 0"),
        (("--max-context", "1"), "--max-context 1"),
        (("--shutdown-timeout", "-1"), "--shutdown-timeout"),
        (("--sync-every", "0"), "--sync-every 0"),
        (("--api-key", " "), "--api-key"),
        (("--device", "cuda"), "cuda"),
    ],
)
def test_bad_options_are_one_line(cli, one_line_error, shard_dir: Path, args: tuple[str, ...], words: str) -> None:
    code = 3 if "cuda" in args else 2  # no GPU here: the environment refuses
    assert words in one_line_error(cli("serve", shard_dir, *args, expect=code), code)


def test_not_a_shard_directory(cli, one_line_error, tmp_path: Path) -> None:
    one_line_error(cli("serve", tmp_path / "nothing", expect=2), 2)
    one_line_error(cli("serve", tmp_path, expect=2), 2)


def test_a_taken_port_is_refused_before_loading(cli, one_line_error, shard_dir: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        line = one_line_error(cli("serve", shard_dir, "--port", port, expect=3), 3)
    assert f"--port {port}" in line and "cannot listen" in line


def test_the_gil_knob_is_checked(cli, one_line_error, shard_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLAMO2_SERVE_SWITCH_INTERVAL", "abc")
    assert "PLAMO2_SERVE_SWITCH_INTERVAL" in one_line_error(cli("serve", shard_dir, expect=2), 2)
