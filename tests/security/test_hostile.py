"""Issue 21, class 3: hostile structure, bounded.  Every JSON we read has depth and size limits,
every field a type check before use, numeric options are finite and in range, running out of
memory is exit 3 with the size asked, lm-eval's `--model_args` repeating a key lm-eval sets is
merged by a stated rule, and a package missing behind `--trust-remote-code` is exit 3 naming it.
Each case here was exit 70 with a traceback (or a hang) before."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch

DEEP = "[" * 100_000 + "]" * 100_000  # RecursionError in json.loads
MANIFEST = "plamo2_shards.json"


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _set_header(path: Path, header: bytes) -> None:
    """Replace a safetensors file's header (keeping its data) with `header`, padded to 8."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header += b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header + data[8 + n :])


@pytest.mark.parametrize("command", ["inspect", "convert"])
def test_deeply_nested_config(run, one_line_error, checkpoint, work, command: str) -> None:
    src = _copy(checkpoint("tiny"), work / "ckpt")
    (src / "config.json").write_text(DEEP)
    args = [src, work / "out"] if command == "convert" else [src]
    line = one_line_error(run(command, *args), 2)
    assert "config.json: JSON nested too deeply" in line


def test_config_too_large(run, one_line_error, checkpoint, work) -> None:
    src = _copy(checkpoint("tiny"), work / "ckpt")
    with open(src / "config.json", "wb") as f:
        f.truncate(17 << 20)  # sparse: 17 MiB of zeros, over the 16 MiB limit
    line = one_line_error(run("inspect", src), 2)
    assert "config.json" in line and "more than the" in line


@pytest.mark.parametrize(
    ("manifest", "says"),
    [
        ("[1, 2, 3]", "not a plamo2-shards manifest (the top level is a JSON array)"),
        (DEEP, "JSON nested too deeply"),
        ('{"format": "plamo2-shards", "format_version": 3, "hash": "xxh3-128", "mapping": []}', "malformed manifest"),
        ('{"format": "plamo2-shards", "format_version": 1.5}', "format_version 1.5 is not supported"),
    ],
)
def test_hostile_manifest(run, one_line_error, tiny_shards, work, manifest: str, says: str) -> None:
    shards = _copy(tiny_shards, work / "shards")
    (shards / MANIFEST).write_text(manifest)
    for args in (
        ["check", shards],
        ["merge", shards, work / "merged"],
        ["convert", shards, work / "tp1", "--tp", 1],
        ["generate", shards, "--prompt", "x", "--max-new-tokens", 1],
    ):
        line = one_line_error(run(*args), 2)
        assert says in line, (args, line)


@pytest.mark.parametrize("value", [["a", "b"], {"x": 1}, 7, None])
def test_manifest_tensor_source_of_the_wrong_type(run, one_line_error, tiny_shards, work, value) -> None:
    """Found by the long fuzz campaign (reports/fuzz/): a tensor record's `source` that is a list
    reached a set lookup in the reshard source (TypeError, exit 70)."""
    shards = _copy(tiny_shards, work / "shards")
    m = json.loads((shards / MANIFEST).read_text())
    next(iter(m["tensors"]["0"].values()))["source"] = value
    (shards / MANIFEST).write_text(json.dumps(m))
    for args in (["convert", shards, work / "tp1", "--tp", 1], ["check", shards]):
        line = one_line_error(run(*args), 2)
        assert "malformed manifest" in line, line


def test_manifest_list_in_an_output_directory(run, one_line_error, checkpoint, work) -> None:
    """convert read an existing manifest's fingerprint with `.get` on whatever JSON it held."""
    out = work / "out"
    out.mkdir()
    (out / MANIFEST).write_text("[]")
    line = one_line_error(run("convert", checkpoint("tiny"), out), 2)
    assert "different completed conversion" in line or "not empty" in line


@pytest.mark.parametrize(
    ("header", "says"),
    [
        (b'{"__metadata__": ["a", "b"]}', "__metadata__ must map names to strings"),
        (b'{"a": ' + DEEP.encode() + b"}", "corrupt header: JSON nested too deeply"),
        (b'{"a": {"dtype": "F32", "shape": [1e400], "data_offsets": [0, 4]}}', "corrupt header"),
        (b'{"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}', "corrupt header entry"),
        (b'{"a": {"dtype": "F32", "shape": [true], "data_offsets": [0, 4]}}', "corrupt header entry"),
        (b'{"a": []}', "corrupt header entry"),
    ],
)
def test_hostile_safetensors_header(run, one_line_error, checkpoint, work, header: bytes, says: str) -> None:
    src = _copy(checkpoint("tiny"), work / "ckpt")
    _set_header(src / "model.safetensors", header)
    for command in (["convert", src, work / "out"], ["inspect", src]):
        line = one_line_error(run(*command), 2)
        assert says in line, line


@pytest.mark.parametrize("size", ["inf", "nan", "-inf", "1e400", "1e30", "0", "-5MB", "5XB"])
def test_max_part_size_out_of_range(run, one_line_error, checkpoint, tiny_shards, work, size: str) -> None:
    for args in (["convert", checkpoint("tiny"), work / "out"], ["merge", tiny_shards, work / "merged"]):
        line = one_line_error(run(*args, "--max-part-size", size), 2)
        assert "size" in line, line
    assert not (work / "out").exists() or not list((work / "out").iterdir())


@pytest.mark.parametrize(
    ("option", "value"),
    [("--temperature", "nan"), ("--temperature", "inf"), ("--top-p", "nan"), ("--max-new-tokens", "0")],
)
def test_sampling_options_out_of_range(run, one_line_error, tiny_shards, option: str, value: str) -> None:
    line = one_line_error(run("generate", tiny_shards, "--prompt", "x", option, value), 2)
    assert option in line


def test_missing_shard_file_in_a_reshard_source(run, one_line_error, tiny_shards, work) -> None:
    shards = _copy(tiny_shards, work / "shards")
    (shards / "model-rank-1-part-0.safetensors").unlink()
    for args in (["convert", shards, work / "tp1", "--tp", 1], ["merge", shards, work / "merged"]):
        line = one_line_error(run(*args), 2)
        assert "model-rank-1-part-0.safetensors" in line and ("missing" in line or "cannot read" in line), line


def test_deep_tokenizer_row(run, one_line_error, tiny_shards, work) -> None:
    """tokenizer.jsonl is checked by the digests first: a changed one is refused as changed; in
    an HF checkpoint (no digests) a hostile row is one line too."""
    src = work / "ckpt"
    shutil.copytree(tiny_shards, src)
    (src / MANIFEST).unlink()
    (src / "tokenizer.jsonl").write_text(DEEP + "\n")
    line = one_line_error(run("tokenize", src, input='"hi"\n'), 2)
    assert "tokenizer.jsonl:1: JSON nested too deeply" in line


def test_report_with_wrong_typed_fields(run, one_line_error, checkpoint, work) -> None:
    """A convert result whose `files_reused` is a number (main's report: TypeError, exit 70):
    that file is skipped as malformed; with nothing else to report, one line, exit 2."""
    result = json.loads(run("convert", checkpoint("tiny"), work / "out", "--json").stdout)
    result["files_reused"] = 5
    runs = work / "runs"
    runs.mkdir()
    (runs / "bad.json").write_text(json.dumps(result))
    line = one_line_error(run("report", runs / "bad.json", "--out", work / "r.md"), 2)
    assert "malformed" in line
    (runs / "good.json").write_text(run("check", work / "out", "--json").stdout)
    r = run("report", runs, "--out", work / "r.md")
    assert r.returncode == 0 and "Traceback" not in r.stderr and not r.stderr.strip(), r.stderr
    assert "malformed convert file" in (work / "r.md").read_text()


def test_model_args_repeating_lm_evals_own_keys(tiny_shards) -> None:
    """`lm-eval run --model plamo2 --model_args pretrained=...,device=cpu` passed `device` twice
    (a TypeError): --model_args wins."""
    from plamo2_tools.eval.plamo2_lm import PlamoLM

    lm = PlamoLM.create_from_arg_string(
        f"pretrained={tiny_shards},device=cpu,batch_size=2", {"device": "cuda:0", "batch_size": 1}
    )
    assert lm.device_name == "cpu" and lm.batch_size == 2


def test_remote_code_needing_a_missing_package(run, one_line_error, tiny_shards, work) -> None:
    src = work / "ckpt"
    shutil.copytree(tiny_shards, src)
    (src / MANIFEST).unlink()
    (src / "tokenization_hostile.py").write_text("import plamo2_no_such_package\n")
    config = json.loads((src / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": ["tokenization_hostile.HostileTokenizer", None]}
    (src / "tokenizer_config.json").write_text(json.dumps(config))
    line = one_line_error(run("tokenize", src, "--trust-remote-code", input='"hi"\n'), 3)
    assert "needs the package plamo2_no_such_package" in line


def test_out_of_memory_says_the_size_asked() -> None:
    """The CPU allocator's real refusal (it raises RuntimeError, not MemoryError) becomes exit 3
    with the size asked."""
    from plamo2_tools.cli.errors import is_out_of_memory, out_of_memory_line

    try:
        torch.empty(1 << 60, dtype=torch.uint8)
    except RuntimeError as e:
        assert is_out_of_memory(e)
        assert out_of_memory_line(e).startswith(f"out of memory (CPU): {1 << 60} bytes were asked for")
    else:
        pytest.skip("this machine allocated 1 EiB")


@pytest.mark.gpu
def test_out_of_memory_on_the_gpu_says_the_size_asked() -> None:
    """CUDA's own OutOfMemoryError for an impossible allocation: exit 3's line names the GPU and the size."""
    from plamo2_tools.cli.errors import is_out_of_memory, out_of_memory_line

    with pytest.raises(torch.OutOfMemoryError) as caught:
        torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
    assert is_out_of_memory(caught.value)
    line = out_of_memory_line(caught.value)
    # torch 2.11 on the H200 says "Tried to allocate 1048576.00 GiB" (seen there, issue 21)
    assert line.startswith("out of memory (GPU): 1048576.00 GiB were asked for"), line


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_fifo_config_is_refused_at_once(run, one_line_error, checkpoint, work) -> None:
    src = _copy(checkpoint("tiny"), work / "ckpt")
    (src / "config.json").unlink()
    os.mkfifo(src / "config.json")
    for args in (["inspect", src], ["convert", src, work / "out"]):
        line = one_line_error(run(*args, timeout=60), 2)
        assert "config.json: is a FIFO, not a regular file" in line
