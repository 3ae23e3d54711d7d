"""The torch-free numeric path (numerics.py, layout.apply_values) against PyTorch, the formulation
the shards were first written with.

1. Casts, bit for bit, on the values where rounding rules differ: ties, subnormals, overflow,
   inf, NaN, and random bit patterns of every width.
2. Whole conversions run twice, once as convert runs now and once with torch doing the value
   work (the oracle: `layout.apply_transforms` / `invert_transforms`, the code convert used to
   run), over presets x layouts x --dtype x source kinds; every output byte must be the same except
   in A = -exp(A_log), where torch's float32 exp is not correctly rounded (numerics.py) and one
   ulp is allowed (four when A itself was first rebuilt from shards: log, then exp).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from plamo2_tools import numerics
from plamo2_tools.convert import sources, writer
from plamo2_tools.convert.engine import convert
from plamo2_tools.convert.merge import merge
from plamo2_tools.dtypes import BFLOAT16, FLOAT8_E4M3, FLOAT8_E5M2, FLOAT16, FLOAT32, DType
from plamo2_tools.errors import LayoutError
from plamo2_tools.model.layout import apply_transforms, invert_transforms
from plamo2_tools.safetensors_io import read_array, read_header

# ---- 1. casts ------------------------------------------------------------------------------------
RNG = np.random.default_rng(22)
# Lengths that are whole vectors of torch's CPU loops: its scalar tail loop treats NaN payloads
# differently from its own vector loop for float16 -> float32 (numerics.py); numbers never differ.
N = 4096
# torch is our oracle for numbers only.  Its NaN payloads depend on the CPU path it takes (its vector
# loops on AVX2/AVX-512 machines, its scalar code under ATEN_CPU_CAPABILITY=default or on a CPU without
# them: f32 -> bf16 NaN is 0xFFFF on one, 0x7FC0 on the other), so NaN inputs are checked against the
# rule numerics.py documents, written out again below (`nan_rule`), and the test means the same anywhere.


def torch_cast(x: np.ndarray, src: DType, dst: DType) -> np.ndarray:
    return numerics.from_torch(numerics.to_torch(x, src).to(dst.torch))[0]


def is_nan_bits(x: np.ndarray, src: DType) -> np.ndarray:
    """NaN inputs, told from the bit patterns alone (IEEE layouts; e4m3fn's NaN is S.1111.111)."""
    bits = x.view(f"u{src.itemsize}").astype(np.uint32)
    exp_man = {
        FLOAT32: (0x7F800000, 0x007FFFFF),
        BFLOAT16: (0x7F80, 0x007F),
        FLOAT16: (0x7C00, 0x03FF),
        FLOAT8_E5M2: (0x7C, 0x03),
    }
    if src == FLOAT8_E4M3:
        return (bits & 0x7F) == 0x7F
    e, m = exp_man[src]
    return ((bits & e) == e) & ((bits & m) != 0)


def nan_rule(bits: np.ndarray, src: DType, dst: DType) -> np.ndarray:
    """Output bits for NaN inputs (uint32 bit patterns of `src`), as numerics.py's docstring states the
    rule (torch's vector loops, F16C): to bfloat16, 0xFFFF from float32 and 0x7FC0 from the narrow
    types; to float32, the float32 a NaN widens to; to float16, sign | quiet | the payload's top bits."""
    sign16 = {FLOAT32: bits >> 16, BFLOAT16: bits, FLOAT16: bits, FLOAT8_E5M2: bits << 8, FLOAT8_E4M3: bits << 8}[
        src
    ] & 0x8000
    if dst == BFLOAT16:
        return np.full_like(bits, 0xFFFF if src == FLOAT32 else 0x7FC0)
    if src == FLOAT32:
        wide = bits
    elif src == BFLOAT16:
        wide = bits << 16
    elif src == FLOAT8_E4M3:  # no payload to keep: sign | exponent | quiet bit | 0x300000
        wide = (sign16 << 16) | 0x7FF00000
    else:  # float16 (and e5m2, the top byte of a float16): widened by F16C, which quiets
        half = bits if src == FLOAT16 else bits << 8
        wide = (sign16 << 16) | 0x7FC00000 | ((half & 0x3FF) << 13)
    if dst == FLOAT32:
        return wide
    return ((wide >> 16) & 0x8000) | 0x7E00 | ((wide >> 13) & 0x3FF)


def expected_cast(x: np.ndarray, src: DType, dst: DType) -> np.ndarray:
    """torch's `.to(dst)` for numbers, `nan_rule` for NaN inputs (see the note at N)."""
    want = torch_cast(x, src, dst)
    nan = is_nan_bits(x, src)
    if src != dst and nan.any():
        out_bits = want.view(f"u{dst.itemsize}")
        out_bits[nan] = nan_rule(x.view(f"u{src.itemsize}").astype(np.uint32)[nan], src, dst).astype(out_bits.dtype)
    return want


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype.itemsize == b.dtype.itemsize and bytes(a.tobytes()) == bytes(b.tobytes())


def f32_bits(values: list[int]) -> np.ndarray:
    return np.resize(np.array(values, np.uint32), N).view(np.float32)


SPECIAL_F32 = [
    0x3F808000,  # 1 + 2^-8: a bfloat16 tie, rounds down to even
    0x3F818000,  # 1 + 3 * 2^-8: a tie, rounds up to even
    0x3F808001,  # just above a tie
    0x3F807FFF,  # just below a tie
    0x3F801000,  # 1 + 2^-11: a float16 tie
    0x3F803000,  # a float16 tie, rounds up
    0x00000001,
    0x80000001,
    0x007FFFFF,
    0x00400000,
    0x00008000,
    0x00018000,  # float32 subnormals
    0x33000000,
    0x33000001,
    0x387FC000,
    0x38800000,
    0x337FFFFF,  # around float16's subnormals
    0x7F7FFFFF,
    0x7F7F8000,
    0x7F7F7FFF,
    0x477FF000,
    0x477FEFFF,
    0xC77FF000,  # overflow to inf
    0x7F800000,
    0xFF800000,
    0x00000000,
    0x80000000,  # inf, zeros
    0x7FC00000,
    0xFFC00000,
    0x7F800001,
    0xFF812345,
    0x7FA00000,
    0xFFFFFFFF,  # NaN: quiet, signalling
]


@pytest.mark.parametrize("dst", [BFLOAT16, FLOAT16, FLOAT32], ids=str)
def test_float32_rounding_matches_torch_on_ties_subnormals_inf_nan(dst: DType) -> None:
    x = f32_bits(SPECIAL_F32)
    ours, theirs = numerics.cast(x, FLOAT32, dst), expected_cast(x, FLOAT32, dst)
    bad = [
        hex(int(x.view(np.uint32)[i]))
        for i in range(len(SPECIAL_F32))
        if ours[i : i + 1].tobytes() != theirs[i : i + 1].tobytes()
    ]
    assert same_bits(ours, theirs), f"{dst}: differs from torch (numbers) or the NaN rule for float32 bits {bad}"


def test_bfloat16_ties_go_to_even() -> None:
    """An independent statement of the rule (not torch's word): halfway values keep an even last bit."""
    x = f32_bits([0x3F808000, 0x3F818000, 0xBF808000, 0x3F80C000])
    assert list(numerics.cast(x, FLOAT32, BFLOAT16)[:4]) == [0x3F80, 0x3F82, 0xBF80, 0x3F81]


def random_bits(dtype: DType, n: int = 200_000) -> np.ndarray:
    raw = RNG.integers(0, 2 ** (8 * dtype.itemsize), n, dtype=np.uint64)
    return raw.astype(f"u{dtype.itemsize}").view(dtype.np)


WIDE = [FLOAT32, BFLOAT16, FLOAT16, FLOAT8_E4M3, FLOAT8_E5M2]


@pytest.mark.parametrize("src", WIDE, ids=str)
@pytest.mark.parametrize("dst", [FLOAT32, BFLOAT16, FLOAT16], ids=str)
def test_every_cast_matches_torch_on_random_bit_patterns(src: DType, dst: DType) -> None:
    x = random_bits(src, 200_704)  # a multiple of every vector width (see N)
    assert same_bits(numerics.cast(x, src, dst), expected_cast(x, src, dst))


def test_the_nan_rule_is_exercised() -> None:
    """The NaN oracle is not vacuous: random patterns hold NaNs of every source width, and the rule tells
    them apart (payload and sign reach float32 and float16 outputs)."""
    for src in WIDE:
        assert is_nan_bits(random_bits(src, 200_704), src).sum() > 100, src
    x = f32_bits([0x7FC00000, 0xFFC00000, 0x7FA12345])[:3]
    assert len({int(v) for v in nan_rule(x.view(np.uint32), FLOAT32, FLOAT16)}) == 3


@pytest.mark.parametrize("src", [FLOAT32, BFLOAT16, FLOAT16], ids=str)
def test_offset_and_exp_chains_match_torch(src: DType) -> None:
    """add_offset rounds like torch's float32 add; exp is within one ulp of torch's (and is the
    correctly rounded value, which torch's is not always)."""
    from plamo2_tools.model.layout import Transform, apply_values

    x = numerics.cast(RNG.normal(0, 0.3, N).astype(np.float32), FLOAT32, src)
    for offset in (1.0, 0.0, 1 / 3, -2.5):
        chain = (Transform("add_offset", offset),)
        for dst in (src, FLOAT32, BFLOAT16):
            ours = apply_values(x, src, chain, dst)
            theirs = numerics.from_torch(apply_transforms(numerics.to_torch(x, src), chain, dst))[0]
            assert same_bits(ours, theirs), (offset, dst)
    a_log = np.log(RNG.uniform(1, 16, N)).astype(np.float32)
    a = apply_values(a_log, FLOAT32, (Transform("neg_exp_f32"),), FLOAT32)
    ref = numerics.from_torch(-torch.exp(torch.from_numpy(a_log)))[0]
    assert ulps(a, ref).max() <= 1
    exact = (-np.exp(a_log.astype(np.float64))).astype(np.float32)
    assert same_bits(a, exact)


def correctly_rounded_exp(x: float) -> np.float32:
    """exp(x) rounded to the nearest float32 (ties to even), decided with 60-digit decimals: an oracle
    that shares no code with numpy, libm or any SIMD path, so it means the same on every CPU."""
    import decimal

    with decimal.localcontext() as ctx:
        ctx.prec = 60
        exact = decimal.Decimal(float(x)).exp()
        guess = np.float32(float(exact))
        candidates = [np.nextafter(guess, np.float32(-np.inf)), guess, np.nextafter(guess, np.float32(np.inf))]
        best = min(candidates, key=lambda c: (abs(decimal.Decimal(float(c)) - exact), int(c.view(np.int32)) & 1))
    return np.float32(best)


def test_exp_is_correctly_rounded_on_any_cpu() -> None:
    """numerics.exp_float32 (A = -exp(A_log)) against exact decimal arithmetic on fresh random inputs over
    PLaMo's A_log range and beyond: equal bit for bit.  Fails for torch's float32 exp on this many inputs
    (one ulp off on ~1 %), and would fail if exp were computed in float32 or rounded twice through float16."""
    x = np.concatenate([RNG.uniform(-4, 4, 3000), RNG.uniform(-80, 80, 1000)]).astype(np.float32)
    want = np.array([correctly_rounded_exp(v) for v in x.tolist()], dtype=np.float32)
    got = numerics.exp_float32(x)
    bad = np.flatnonzero(got.view(np.int32) != want.view(np.int32))
    assert not len(bad), f"{len(bad)} of {len(x)} not correctly rounded, e.g. exp({x[bad[0]]!r})"


def ulps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Distance in float32 steps (same-sign values)."""
    return np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64))


# ---- 2. whole conversions ------------------------------------------------------------------------
def torch_transformed(x: np.ndarray, src: DType, transforms: Any, dtype: DType) -> np.ndarray:
    return numerics.from_torch(apply_transforms(numerics.to_torch(x, src), transforms, dtype))[0]


def torch_read_rows(self: sources.ShardSource, name: str, start: int, stop: int) -> np.ndarray:
    """ShardSource.read_rows as it was written in torch (the oracle)."""
    src = self.tensors[name]
    out = torch.zeros((stop - start, *src.shape[1:]), dtype=src.dtype.torch)
    for piece, entry, offset in self._pieces.get(name, []):
        fd, infos = self._file(entry.file)
        info = infos[entry.tensor.key]
        if piece.dim == 0:
            lo, hi = max(start, piece.start), min(stop, piece.start + piece.length)
            if lo >= hi:
                continue
            first = offset + lo - piece.start
            rows = numerics.to_torch(read_array(fd, info, first, first + hi - lo), info.dtype)
            out[lo - start : hi - start] = invert_transforms(rows, entry.tensor.transforms, src.dtype)
        else:
            rows = numerics.to_torch(read_array(fd, info, start, stop), info.dtype)
            out[:, piece.start : piece.start + piece.length] = invert_transforms(
                rows, entry.tensor.transforms, src.dtype
            )
    return numerics.from_torch(out)[0]


def both(monkeypatch: pytest.MonkeyPatch, run: Any, out: Path) -> tuple[Path, Path]:
    """Run `run(dir)` with the numpy path into out/np and with torch doing the values into out/pt."""
    run(out / "np")
    with monkeypatch.context() as m:
        m.setattr(writer, "transformed", torch_transformed)
        m.setattr(sources.ShardSource, "read_rows", torch_read_rows)
        run(out / "pt")
    return out / "np", out / "pt"


def assert_same_output(ours: Path, theirs: Path, a_ulps: int = 1) -> int:
    """Every file byte-identical but A's values (within `a_ulps`); returns how many A values differ."""
    names = sorted(p.name for p in ours.glob("*.safetensors"))
    assert names == sorted(p.name for p in theirs.glob("*.safetensors")) and names
    differing = 0
    for name in names:
        a, b = (ours / name).read_bytes(), (theirs / name).read_bytes()
        if a == b:
            continue
        ha, hb = read_header(ours / name), read_header(theirs / name)
        assert a[: ha.data_start] == b[: hb.data_start], f"{name}: headers differ"
        for key, info in ha.tensors.items():
            x, y = a[info.offset : info.offset + info.nbytes], b[info.offset : info.offset + info.nbytes]
            if x == y:
                continue
            is_a = key.endswith(("mixer.A", "mixer.A_log")) and info.dtype == FLOAT32
            assert is_a, f"{name}: {key} differs between the numpy and the torch path"
            d = ulps(np.frombuffer(x, np.float32), np.frombuffer(y, np.float32))
            assert d.max() <= a_ulps, f"{name}: {key}: {int(d.max())} ulps"
            differing += int(np.count_nonzero(d))
    return differing


PRESETS = ["tiny", "tiny-gqa", "tiny-edge", "tiny-2.1", "tiny3", "tiny3-mqa", "tiny3-yarn"]
LAYOUTS = [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (4, 2)]
DTYPES = ["auto", "bfloat16", "float16", "float32"]


def convert_to(src: Path, tp: int, pp: int, dtype: str, out: Path) -> None:
    convert(src, out, tp=tp, pp=pp, dtype=dtype, workers=2)


@pytest.mark.parametrize("preset", PRESETS)
def test_presets_layouts_dtypes_byte_identical(preset: str, checkpoint, monkeypatch, tmp_path: Path) -> None:
    src = checkpoint(preset)
    done = 0
    for tp, pp in LAYOUTS:
        for dtype in DTYPES:
            out = tmp_path / f"tp{tp}pp{pp}-{dtype}"
            try:
                ours, theirs = both(monkeypatch, partial(convert_to, src, tp, pp, dtype), out)
            except LayoutError:
                break  # this preset cannot be split so: no dtype can
            assert_same_output(ours, theirs)
            shutil.rmtree(out)
            done += 1
    assert done >= 8, f"{preset}: only {done} layouts x dtypes were valid"


@pytest.mark.parametrize("source_dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("preset", ["tiny", "tiny3"])
def test_narrow_sources_byte_identical(preset: str, source_dtype: str, checkpoint, monkeypatch, tmp_path) -> None:
    src = checkpoint(preset, dtype=source_dtype)
    for tp, pp in [(1, 1), (2, 2)]:
        for dtype in DTYPES:
            out = tmp_path / f"tp{tp}pp{pp}-{dtype}"
            assert_same_output(*both(monkeypatch, partial(convert_to, src, tp, pp, dtype), out))


def hf_cache_snapshot(src: Path, root: Path) -> Path:
    """The layout of a Hugging Face cache: the snapshot's weights are links to blobs named by sha256."""
    snap = root / "models--pfnet--tiny" / "snapshots" / ("a" * 40)
    blobs = root / "models--pfnet--tiny" / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for p in src.iterdir():
        if p.suffix == ".safetensors":
            blob = blobs / hashlib.sha256(p.read_bytes()).hexdigest()
            shutil.copyfile(p, blob)
            (snap / p.name).symlink_to(Path("../../blobs") / blob.name)
        elif p.is_file():
            shutil.copyfile(p, snap / p.name)
    return snap


@pytest.mark.parametrize("kind", ["index", "hf-cache", "shards"])
@pytest.mark.parametrize("preset", ["tiny-gqa", "tiny3-mqa"])
def test_source_kinds_byte_identical(kind: str, preset: str, checkpoint, monkeypatch, tmp_path: Path) -> None:
    if kind == "index":
        srcs = {"auto": checkpoint(preset, files=3)}
        assert json.loads((srcs["auto"] / "model.safetensors.index.json").read_text())["weight_map"]
    elif kind == "hf-cache":
        srcs = {"auto": hf_cache_snapshot(checkpoint(preset), tmp_path / "cache")}
    else:  # shards of each --dtype as the source: a reshard
        srcs = {}
        for dtype in DTYPES:
            srcs[dtype] = tmp_path / f"first-{dtype}"
            convert(checkpoint(preset), srcs[dtype], tp=2, pp=1, dtype=dtype, workers=2)
    for first, src in srcs.items():
        for tp, pp in [(1, 1), (4, 1), (2, 2)]:
            for dtype in DTYPES:
                out = tmp_path / f"{first}-tp{tp}pp{pp}-{dtype}"
                pair = both(monkeypatch, partial(convert_to, src, tp, pp, dtype), out)
                assert_same_output(*pair, a_ulps=4 if kind == "shards" else 1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_byte_identical(dtype: str, checkpoint, monkeypatch, tmp_path: Path) -> None:
    shards = tmp_path / "shards"
    convert(checkpoint("tiny-gqa"), shards, tp=2, pp=2, dtype=dtype, workers=2)
    ours, theirs = both(monkeypatch, lambda o: merge(shards, o), tmp_path / "merged")
    assert_same_output(ours, theirs, a_ulps=4)


def test_casts_without_a_numpy_rounding_go_through_torch() -> None:
    """float8 outputs and float64 -> 16-bit floats: numpy has no exact rounding, torch does it."""
    from plamo2_tools.dtypes import FLOAT64
    from plamo2_tools.model.layout import Transform, apply_values, invert_values

    x = np.arange(256, dtype=np.uint8)
    chain = (Transform("add_offset", 1.0),)
    ours = apply_values(x, FLOAT8_E4M3, chain, FLOAT8_E4M3)
    assert same_bits(ours, torch_transformed(x, FLOAT8_E4M3, chain, FLOAT8_E4M3))
    back = invert_values(ours, FLOAT8_E4M3, chain, FLOAT8_E4M3)
    assert same_bits(
        back, numerics.from_torch(invert_transforms(numerics.to_torch(ours, FLOAT8_E4M3), chain, FLOAT8_E4M3))[0]
    )
    d = RNG.normal(size=N)
    for dst in (BFLOAT16, FLOAT16):
        cast = (Transform("cast", dst.name),)
        assert same_bits(apply_values(d, FLOAT64, cast, dst), torch_transformed(d, FLOAT64, cast, dst))


@pytest.mark.parametrize("preset", ["tiny-gqa", "tiny3-mqa"])
def test_gathers_in_the_kernel_write_and_hash_what_user_space_does(
    preset: str, checkpoint, monkeypatch, tmp_path
) -> None:
    """Row-parallel columns copied one row at a time by copy_file_range and hashed from the output
    (writer.ROW_COPY_MIN; the tiny rows are below it, so it is lowered here) against the gather in
    user space: the same bytes and the same recorded digests."""
    from plamo2_tools.shards.check import check_shards

    src = checkpoint(preset)
    outs = {}
    for name, limit in (("kernel", 1), ("user", 2**62)):
        monkeypatch.setattr(writer, "ROW_COPY_MIN", limit)
        outs[name] = tmp_path / name
        result = convert(src, outs[name], tp=2, pp=2, workers=2)
        assert result.copy["bytes"]["gather"] > 0
        assert check_shards(outs[name]).ok
    names = sorted(p.name for p in outs["user"].glob("*.safetensors"))
    for name in names:
        assert (outs["kernel"] / name).read_bytes() == (outs["user"] / name).read_bytes(), name
    manifests = [json.loads((outs[k] / "plamo2_shards.json").read_text()) for k in ("kernel", "user")]
    assert manifests[0]["files"] == manifests[1]["files"]


def test_a_kernel_gather_refused_half_way_finishes_in_user_space(checkpoint, monkeypatch, tmp_path) -> None:
    """copy_file_range refused in the middle of a row-by-row gather (EXDEV after some rows): the
    rest goes through sendfile / user space, and the files are those of a user-space gather."""
    import errno
    import os

    src = checkpoint("tiny-gqa")
    monkeypatch.setattr(writer, "ROW_COPY_MIN", 2**62)
    convert(src, tmp_path / "user", tp=2, pp=1, workers=1)
    monkeypatch.setattr(writer, "ROW_COPY_MIN", 1)
    real, calls = os.copy_file_range, [0]

    def refuse_later(*args: int) -> int:
        calls[0] += 1
        if calls[0] > 30:
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))
        return real(*args)

    monkeypatch.setattr(os, "copy_file_range", refuse_later)
    result = convert(src, tmp_path / "kernel", tp=2, pp=1, workers=1)
    assert calls[0] > 30 and result.copy["bytes"]["sendfile"] > 0
    for p in sorted((tmp_path / "user").glob("*.safetensors")):
        assert (tmp_path / "kernel" / p.name).read_bytes() == p.read_bytes(), p.name
