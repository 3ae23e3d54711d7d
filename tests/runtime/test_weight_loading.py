"""Shard files are loaded in one pass, their digests taken from the very bytes that were loaded
(runtime/rank/weights.py, issue 33): what comes back is exactly what the safetensors library reads
from the files, in any piece size and every shard format version, and a file whose digest fails is
refused with nothing handed out, so nothing runs on it.

Seen failing: with the last piece of each file left out of its digest (`FileDigest.update`
returning early for a tensor's last piece) every tampered file loads; with each piece written at
the start of its tensor, the byte comparison fails wherever a tensor spans pieces.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from plamo2_tools.errors import CheckpointError
from plamo2_tools.runtime.batching.engine import Runtime
from plamo2_tools.runtime.rank import weights
from plamo2_tools.safetensors_io import read_header
from plamo2_tools.shards.integrity import verify_shard_files
from plamo2_tools.shards.manifest import load_manifest

FIXTURES = Path(__file__).parents[1] / "shards" / "fixtures"
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def current(shards) -> Path:
    """Format 3, bf16, TP 2, several files per rank (--max-part-size), so tensors span pieces."""
    return shards("tiny-gqa", 2, 1, "--max-part-size", "40KiB", dtype="bfloat16", seed=11)


def library(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - a safe_open handle


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


@pytest.mark.parametrize("chunk", [7, 4096, weights.CHUNK])
@pytest.mark.parametrize("which", ["v1", "v2", "current"])
def test_loaded_tensors_are_the_files_bytes(
    current: Path, monkeypatch: pytest.MonkeyPatch, chunk: int, which: str
) -> None:
    """7-byte pieces cut every tensor at odd places; every rank's every file, every tensor."""
    monkeypatch.setattr(weights, "CHUNK", chunk)
    path = {"v1": FIXTURES / "v1-tiny-edge-tp2pp2", "v2": FIXTURES / "v2-tiny-edge-tp2pp2", "current": current}[which]
    m = load_manifest(path)
    for rank in range(m.mapping.world_size):
        got = weights.load_rank_weights(m, rank, CPU)
        want = {k: t for name in m.rank_files(rank) for k, t in library(path / name).items()}
        assert set(got) == set(want)
        for key, tensor in want.items():
            assert same_bytes(got[key], tensor), key
    if which == "current":
        assert max(len(m.rank_files(r)) for r in range(m.mapping.world_size)) > 1


def flip(path: Path, where: str) -> tuple[str, int]:
    """Flip one payload byte of a shard file (first tensor's first, a middle one, the file's last);
    the tensor it belongs to and its offset in it."""
    header = read_header(path)
    order = sorted(header.tensors.values(), key=lambda t: t.offset)
    info = {"first": order[0], "middle": order[len(order) // 2], "last": order[-1]}[where]
    at = {"first": 0, "middle": info.nbytes // 2, "last": info.nbytes - 1}[where]
    data = bytearray(path.read_bytes())
    data[info.offset + at] ^= 0x5A
    path.write_bytes(bytes(data))
    return info.name, at


@pytest.mark.parametrize("which", ["v1", "current"])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_tampered_byte_is_refused_and_nothing_runs(current: Path, tmp_path: Path, which: str, where: str) -> None:
    src = {"v1": FIXTURES / "v1-tiny-edge-tp2pp2", "current": current}[which]
    path = tmp_path / "shards"
    shutil.copytree(src, path)
    m = load_manifest(path)
    name = m.rank_files(1)[0]
    key, at = flip(path / name, where)
    verify_shard_files(m, range(m.mapping.world_size), digests=False)  # headers intact: only the digest can tell
    with pytest.raises(CheckpointError, match=rf"{name}: {m.hash} digest differs from the manifest"):
        weights.load_rank_weights(m, 1, CPU)
    with pytest.raises(CheckpointError, match=rf"{name}: {m.hash} digest differs"):
        Runtime(path, backend="torch")
    loaded = weights.load_rank_weights(m, 1, CPU, verify=False)  # the escape hatch: the flipped byte is there
    original = library(src / name)[key]
    assert not same_bytes(loaded[key], original)
    assert loaded[key].reshape(-1).view(torch.uint8)[at] == original.reshape(-1).view(torch.uint8)[at] ^ 0x5A
