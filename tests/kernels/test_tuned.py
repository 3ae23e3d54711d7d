"""Tuned kernel tables shipped as data (kernels/tuned.py, issue 33), on the CPU with a fake card.

* A table written by `write_table` reads back for its card only; a file that is not valid, is not
  ours, is of another schema or names another card or capability is ignored (the kernels then
  measure, as on any card without a table), never a crash.
* The SSD pick takes the exact bucket, else the nearest one of the same shapes in log2 tokens and
  sequences; a value that is not a known choice never counts.
* Seeding a real Triton autotuner (two configs, run under the interpreter, where benchmarking needs
  a GPU driver and fails): the seeded shape runs without benchmarking; a shape not seeded, or an
  entry naming a config outside the kernel's list, does not (it would have to benchmark).
* Every table shipped in the package names only configs of the kernels' own lists.

Seen failing: with `seed_autotuner` taking the file's config as given instead of the kernel's own
object, the outside-the-list entry runs; with `table_for` not checking the card, the other-card
file is used.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from plamo2_tools.errors import CheckpointError
from plamo2_tools.kernels import gemv, ssd, tuned

CARD = tuned.Card("Fake Card 9000 (80GB)", "9.9")
SSD_KEY = (32, 64, 128, "torch.bfloat16", False, True)  # H, P, N, dtype, z is None, init is None


def valid_choice(v: object) -> bool:
    return isinstance(v, list) and len(v) == 2 and tuple(v) in ssd.AUTO_CHOICES


def write(directory: Path, **overrides: object) -> Path:
    path = tuned.write_table(
        directory / f"{CARD.slug}.json",
        CARD,
        {
            "ssd_chunk_scan": {tuned.key_text((*SSD_KEY, 4096, 8)): ["parallel", 256]},
            "gemv": {
                "2048|8192|torch.bfloat16|torch.bfloat16|torch.bfloat16": {
                    "kwargs": {"BLOCK_N": 8, "BLOCK_K": 512},
                    "num_warps": 4,
                    "num_stages": 3,
                }
            },
        },
        {"torch": "x"},
    )
    if overrides:
        data = json.loads(path.read_text())
        data.update(overrides)
        path.write_text(json.dumps(data))
    return path


def test_slug() -> None:
    assert tuned.card_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert tuned.card_slug("NVIDIA H200") == "nvidia-h200"
    assert CARD.slug == "fake-card-9000-80gb"


def test_a_table_reads_back_for_its_card_only(tmp_path: Path) -> None:
    write(tmp_path)
    table = tuned.table_for(CARD, tmp_path)
    assert table is not None and table.card == CARD
    assert table.entries("ssd_chunk_scan") == {"32|64|128|torch.bfloat16|False|True|4096|8": ["parallel", 256]}
    assert tuned.table_for(tuned.Card(CARD.name, "8.0"), tmp_path) is None  # same name, other capability
    assert tuned.table_for(tuned.Card("Other Card", "9.9"), tmp_path) is None  # no file
    with pytest.raises(CheckpointError, match="made for Fake Card 9000"):
        tuned.read_table(tmp_path / f"{CARD.slug}.json", tuned.Card(CARD.name, "8.0"))


@pytest.mark.parametrize(
    "damage",
    ["{not json", "[1]", "[" * 5000, json.dumps({"kind": "other"}), "schema", "card", "\udcff"],
    ids=["corrupt", "a list", "deep", "not ours", "other schema", "other card", "not text"],
)
def test_a_bad_table_is_ignored(tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture) -> None:
    path = write(tmp_path)
    if damage == "schema":
        write(tmp_path, schema_version=2)
    elif damage == "card":  # a file under this card's name that says it was made for another
        write(tmp_path, card="NVIDIA H200")
    else:
        path.write_bytes(damage.encode("utf-8", "surrogateescape"))
    tuned._cached_table.cache_clear()
    assert tuned.table_for(CARD, tmp_path) is None
    assert "ignoring the tuned-kernel table" in caplog.text


def test_tables_can_be_turned_off_or_pointed_elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path)
    monkeypatch.setenv("PLAMO2_TUNED_DIR", str(tmp_path))
    assert tuned.table_for(CARD) is not None
    monkeypatch.setenv("PLAMO2_TUNED", "0")
    assert tuned.table_for(CARD) is None


def test_nearest_bucket() -> None:
    entries = {
        tuned.key_text((*SSD_KEY, 4096, 8)): ["parallel", 256],
        tuned.key_text((*SSD_KEY, 256, 1)): ["sequential", 128],
        tuned.key_text((*SSD_KEY, 1024, 2)): ["not a variant", 128],  # never counts
        tuned.key_text((32, 64, 128, "torch.float16", False, True, 1024, 2)): ["parallel", 128],  # other dtype
    }
    assert tuned.nearest_choice(entries, (*SSD_KEY, 4096, 8), valid_choice) == ["parallel", 256]
    assert tuned.nearest_choice(entries, (*SSD_KEY, 8192, 16), valid_choice) == ["parallel", 256]
    assert tuned.nearest_choice(entries, (*SSD_KEY, 128, 1), valid_choice) == ["sequential", 128]
    assert tuned.nearest_choice(entries, (*SSD_KEY, 1024, 2), valid_choice) == ["sequential", 128]  # 2 vs 4 away
    assert tuned.nearest_choice(entries, (16, 64, 128, "torch.bfloat16", False, True, 4096, 8), valid_choice) is None


@triton.autotune(
    configs=[triton.Config({"BLOCK": 16}, num_warps=1), triton.Config({"BLOCK": 32}, num_warps=2)], key=["N"]
)
@triton.jit
def _double(x_ptr, y_ptr, N, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i < N) * 2, mask=i < N)


def _run(n: int) -> torch.Tensor:
    x = torch.arange(n, dtype=torch.float32)
    y = torch.zeros(n, dtype=torch.float32)
    _double[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x, y, n)
    return y


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's missing driver is the witness")
def test_a_seeded_autotuner_does_not_benchmark() -> None:
    _double.cache.clear()
    key = "|".join(["100", "torch.float32", "torch.float32"])
    outside = {"kwargs": {"BLOCK": 64}, "num_warps": 2, "num_stages": 3}  # not one of the kernel's configs
    n = tuned.seed_autotuner(
        _double,
        {key: {"kwargs": {"BLOCK": 32}, "num_warps": 2, "num_stages": 3}, "50|torch.float32|torch.float32": outside},
    )
    assert n == 1
    assert torch.equal(_run(100), 2 * torch.arange(100, dtype=torch.float32))  # ran without benchmarking
    with pytest.raises(RuntimeError, match="driver"):  # not seeded: the autotuner must benchmark
        _run(50)
    assert tuned.autotuner_entries(_double) == {key: {"kwargs": {"BLOCK": 32}, "num_warps": 2, "num_stages": 3}}


SHIPPED = sorted(tuned.TUNED_DIR.glob("*.json"))


def check_table(table: tuned.TunedTable) -> list[str]:
    """Problems of a table against the kernels' own candidate lists."""
    allowed = {"gemv": [tuned.config_value(c) for c in gemv.GPU_CONFIGS]}
    for name, configs in ssd.GPU_OUT_CONFIGS.items():
        allowed[name] = [
            {"kwargs": {"BLOCK_M": m, "BLOCK_K": k, "BLOCK_P": p}, "num_warps": w, "num_stages": s}
            for m, k, p, w, s in configs
        ]
    problems = []
    for kernel, entries in table.kernels.items():
        for text, value in entries.items():
            parts = tuned.parse_key(text)
            if kernel == "ssd_chunk_scan":
                ok = valid_choice(value) and len(parts) == 8
            else:
                ok = value in allowed[kernel] and all(isinstance(p, int) for p in parts[: 2 if kernel == "gemv" else 4])
            if not ok:
                problems.append(f"{kernel} {text}: {value}")
    return problems


def test_check_table_finds_a_planted_problem(tmp_path: Path) -> None:
    table = tuned.read_table(write(tmp_path))
    assert check_table(table) == []
    bad = tuned.TunedTable(CARD, {"gemv": {"1|2|torch.bfloat16": {"kwargs": {"BLOCK_N": 3}, "num_warps": 1}}})
    assert check_table(bad)


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_every_shipped_table_is_valid(path: Path) -> None:
    table = tuned.read_table(path)
    assert path.stem == table.card.slug
    assert check_table(table) == []
