"""What every rank must hold, written straight from docs/model.md §4 and
docs/shard-format.md with plain torch view/chunk/narrow on the full HF tensors.

Deliberately independent of plamo2_tools.model.tensors: nothing here calls the converter's piece
functions, so a slicing bug there cannot hide behind the same bug here.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import safetensors
import torch

from plamo2_tools.model import hf_tensor_shapes
from plamo2_tools.model.plamo2.config import Plamo2Config
from plamo2_tools.shards.manifest import JOURNAL_NAME, MANIFEST_NAME

# docs/model.md §3.1, as literals (not plamo2_tools.model.plamo2.config.NORM_OFFSETS).
LAYER_NORM_OFFSETS = {
    "pre_mixer_norm": 1.0,
    "post_mixer_norm": 0.2,
    "pre_mlp_norm": 1.0,
    "post_mlp_norm": 1 / 5**1.5,
}
FINAL_NORM_OFFSET = 1.0


def vllm_pp_counts(num_layers: int, pp: int) -> list[int]:
    """vLLM's get_pp_indices without VLLM_PP_LAYER_PARTITION (spec section 6): L // p each, the
    remainder one each to partitions[-2], partitions[-3], ..."""
    counts = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        counts[-i] += 1
    return counts


def stage_ranges(counts: list[int]) -> list[range]:
    bounds = [sum(counts[:i]) for i in range(len(counts) + 1)]
    return [range(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


class Watermark:
    """Checkpoint values that encode their own coordinates, exactly in float32.

    Every element of every HF tensor gets a distinct integer: (running offset of the tensor in
    name order) + (flat index), all below 2**24 for the tiny presets, so the value read back from
    a shard says which tensor and which element it came from.  A_log gets the same integer scaled
    by 2**-20 (exact, and small enough for exp).  The rows of an untied lm_head beyond V are
    watermarked too, so taking them instead of zero padding shows.
    """

    def __init__(self, cfg: Plamo2Config) -> None:
        self.shapes = hf_tensor_shapes(cfg)
        self.offsets: dict[str, int] = {}
        cursor = 1  # 0 stays free: zero padding must never look like a real element
        for name in sorted(self.shapes):
            self.offsets[name] = cursor
            cursor += math.prod(self.shapes[name])
        if cursor >= 2**24:
            raise ValueError(f"{cursor} elements do not fit exactly into float32 integers")

    def __call__(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        n = math.prod(shape)
        values = torch.arange(self.offsets[name], self.offsets[name] + n, dtype=torch.float64).reshape(shape)
        if name.endswith("A_log"):
            values = values * 2.0**-20
        return values.to(torch.float32)

    def decode(self, value: float) -> str:
        """'tensor[index]' that a watermark value came from (for readable failures)."""
        for name, scaled in ((n, n.endswith("A_log")) for n in self.offsets):
            v = round(value * 2**20) if scaled else value
            start = self.offsets[name]
            if v == int(v) and start <= v < start + math.prod(self.shapes[name]):
                index = torch.unravel_index(torch.tensor(int(v) - start), self.shapes[name])
                return f"{name}{[int(i) for i in index]}"
        return f"{value!r} (no source element)"


def load_hf(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF checkpoint directory, read with the safetensors library."""
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safetensors.safe_open(str(file), "pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                tensors[key] = f.get_tensor(key)
    return tensors


def rank_files(out: Path, rank: int) -> list[Path]:
    """model-rank-{rank}-part-{n}.safetensors in part order, checking the parts are 0..n-1."""
    files = sorted(out.glob(f"model-rank-{rank}-part-*.safetensors"), key=lambda p: int(p.stem.rsplit("-", 1)[1]))
    assert [int(p.stem.rsplit("-", 1)[1]) for p in files] == list(range(len(files))), files
    return files


def load_rank(out: Path, rank: int) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in rank_files(out, rank):
        with safetensors.safe_open(str(file), "pt") as f:
            for key in f.keys():  # noqa: SIM118
                assert key not in tensors, f"{key} appears in two parts of rank {rank}"
                tensors[key] = f.get_tensor(key)
    return tensors


def file_metadata(path: Path) -> dict[str, str]:
    with safetensors.safe_open(str(path), "pt") as f:
        return f.metadata()


def expected_rank(
    hf: dict[str, torch.Tensor],
    cfg: Plamo2Config,
    tp: int,
    stages: list[range],
    rank: int,
    out_dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor global rank `rank` (= pp_rank * tp + tp_rank) holds, from the spec table."""
    r, stage = rank % tp, rank // tp
    first, last = stage == 0, stage == len(stages) - 1
    D, d = cfg.hidden_size, cfg.hidden_size_per_head
    Hq, Hkv, Hm, V = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.mamba_num_heads, cfg.vocab_size
    Vp = math.ceil(V / 64) * 64

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(out_dtype or t.dtype)

    def mine(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Rank r's contiguous block along dim (heads, channels, columns are all contiguous)."""
        return t.chunk(tp, dim)[r]

    def offset(t: torch.Tensor, off: float) -> torch.Tensor:
        """Added in float32, rounded once to the output dtype."""
        return (t.float() + off).to(out_dtype or t.dtype)

    def vocab(w: torch.Tensor) -> torch.Tensor:
        padded = torch.cat([w[:V], w.new_zeros(Vp - V, D)])  # rows >= V (untied lm_head) never used
        return cast(mine(padded))

    out: dict[str, torch.Tensor] = {}
    embed = hf["model.embed_tokens.weight"]
    if first and not (cfg.tie_word_embeddings and len(stages) == 1):
        out["model.embed_tokens.weight"] = vocab(embed)
    for i in stages[stage]:
        p = f"model.layers.layers.{i}."
        for norm, off in LAYER_NORM_OFFSETS.items():
            out[p + norm + ".weight"] = offset(hf[p + norm + ".weight"], off)
        gate, up = hf[p + "mlp.gate_up_proj.weight"].chunk(2)
        out[p + "mlp.gate_up_proj.weight"] = cast(torch.cat([mine(gate), mine(up)]))
        out[p + "mlp.down_proj.weight"] = cast(mine(hf[p + "mlp.down_proj.weight"], 1))
        m = p + "mixer."
        if m + "in_proj.weight" in hf:  # Mamba
            per_head = hf[m + "in_proj.weight"].view(Hm, 2, d, D)  # [z_h; x_h] per head
            z, x = per_head[:, 0], per_head[:, 1]
            out[m + "in_proj.weight"] = cast(torch.cat([mine(z).reshape(-1, D), mine(x).reshape(-1, D)]))
            out[m + "conv1d.weight"] = cast(mine(hf[m + "conv1d.weight"]))
            out[m + "bcdt_proj.weight"] = cast(mine(hf[m + "bcdt_proj.weight"], 1))
            out[m + "dt_proj.weight"] = cast(mine(hf[m + "dt_proj.weight"]))
            out[m + "A"] = mine(neg_exp_float32(hf[m + "A_log"]))  # always float32
            out[m + "D"] = cast(mine(hf[m + "D"]))
            out[m + "dt_bias"] = cast(mine(hf[m + "dt_bias"]))
            for n in ("dt", "B", "C"):
                out[m + f"{n}_norm.weight"] = cast(hf[m + f"{n}_norm_weight"])
            out[m + "out_proj.weight"] = cast(mine(hf[m + "out_proj.weight"], 1))
        else:  # attention
            q, k, v = hf[m + "qkv_proj.weight"].split([Hq * d, Hkv * d, Hkv * d])
            k_heads, v_heads, k_norm = k.view(Hkv, d, D), v.view(Hkv, d, D), hf[m + "k_weight"]
            if Hkv >= tp:
                k_r, v_r, kn_r = mine(k_heads), mine(v_heads), mine(k_norm)
            else:  # each KV head replicated over tp / Hkv consecutive ranks
                g = r // (tp // Hkv)
                k_r, v_r, kn_r = k_heads[g : g + 1], v_heads[g : g + 1], k_norm[g : g + 1]
            out[m + "qkv_proj.weight"] = cast(torch.cat([mine(q), k_r.reshape(-1, D), v_r.reshape(-1, D)]))
            out[m + "q_norm.weight"] = cast(mine(hf[m + "q_weight"]))
            out[m + "k_norm.weight"] = cast(kn_r)
            out[m + "o_proj.weight"] = cast(mine(hf[m + "o_proj.weight"], 1))
            # vLLM's Attention registers these fp32 scalar buffers (1.0 unquantized); its
            # sharded_state loader requires them on every rank that holds the layer.
            for scale in ("_k_scale", "_v_scale", "_q_scale", "_prob_scale"):
                out[m + "attn." + scale] = torch.tensor(1.0, dtype=torch.float32)
    if last:
        out["model.norm.weight"] = offset(hf["model.norm.weight"], FINAL_NORM_OFFSET)
        out["lm_head.weight"] = vocab(embed if cfg.tie_word_embeddings else hf["lm_head.weight"])
    return out


def neg_exp_float32(a_log: torch.Tensor) -> torch.Tensor:
    """A = -exp(A_log) in float32, element by element with Python's float (double) exp, rounded once.

    Not torch.exp: torch's float32 exp is not correctly rounded (one ulp off on ~1 % of inputs) and
    which inputs depends on the CPU's SIMD width, so an oracle built on it passes on one machine and
    fails on the next.  The double exp rounded to float32 is the correctly rounded value (but for
    ties closer than 2**-29 relative, far rarer than any test's elements); `assert_same_tensors`
    still allows exp-made tensors one ulp (docs/convert.md §the exp rule)."""
    values = [-math.exp(v) for v in a_log.double().reshape(-1).tolist()]
    return torch.tensor(values, dtype=torch.float64).to(torch.float32).reshape(a_log.shape)


# The documented rounding rule (docs/convert.md): tensors made by exp (PLaMo 2's A = -exp(A_log))
# within one float32 ulp, every other tensor bit for bit.
EXP_MADE = re.compile(r"(^|\.)mixer\.A$")


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in float32 steps between same-sign float32 values (0 where bitwise equal)."""
    return (a.contiguous().view(torch.int32).long() - b.contiguous().view(torch.int32).long()).abs()


def assert_same_tensors(
    got: dict[str, torch.Tensor],
    want: dict[str, torch.Tensor],
    where: str,
    decode: Callable[[float], str] | None = None,
) -> None:
    """Same key set, and per key the same dtype, shape and bits; exp-made float32 tensors
    (`EXP_MADE`) within one ulp of the correctly rounded value instead, nothing else."""
    assert sorted(got) == sorted(want), (
        f"{where}: missing {sorted(set(want) - set(got))}, unexpected {sorted(set(got) - set(want))}"
    )
    for key in sorted(want):
        g, w = got[key], want[key]
        assert (g.dtype, tuple(g.shape)) == (w.dtype, tuple(w.shape)), (
            f"{where}: {key}: {g.dtype} {list(g.shape)} != {w.dtype} {list(w.shape)}"
        )
        if torch.equal(_bits(g), _bits(w)):
            continue
        if EXP_MADE.search(key) and w.dtype == torch.float32 and (torch.sign(g) == torch.sign(w)).all():
            worst = int(ulp_distance(g, w).max())
            if worst <= 1:
                continue
            raise AssertionError(f"{where}: {key}: {worst} ulps from the correctly rounded exp (one allowed)")
        diff = (g != w).nonzero()
        if not len(diff):  # equal values, different bits (e.g. -0.0 vs 0.0)
            raise AssertionError(f"{where}: {key}: same values but different bytes")
        bad = diff[0].tolist()
        gv, wv = g[tuple(bad)].item(), w[tuple(bad)].item()
        detail = f" (got {decode(gv)}, expected {decode(wv)})" if decode else ""
        raise AssertionError(f"{where}: {key}{bad}: got {gv!r}, expected {wv!r}{detail}")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def flip_byte(path: Path, offset: int) -> None:
    """Invert one byte in place (offset from the start of the file; negative: from the end)."""
    with open(path, "r+b") as f:
        f.seek(offset, 0 if offset >= 0 else 2)
        pos = f.tell()
        byte = f.read(1)
        f.seek(pos)
        f.write(bytes([byte[0] ^ 0xFF]))


# ---- a real convert, SIGKILLed half way ---------------------------------------------------------
def journaled(out: Path) -> list[str]:
    """The files a (killed) convert's journal lists as finished."""
    try:
        lines = (out / JOURNAL_NAME).read_text().splitlines()[1:]
    except (FileNotFoundError, IndexError):
        return []
    return [json.loads(line)["file"] for line in lines if line.endswith("}")]


def kill_convert_half_way(
    src: Path, out: Path, options: tuple[str, ...], files: int = 1, timeout: float = 120.0
) -> list[str]:
    """Run the real CLI's convert in a subprocess and SIGKILL it once `files` finished files are
    journaled and the next ones are being written (a `.partial` exists: with `--sync end` a file is
    journaled so soon after its unit ends that the next unit may not have begun yet).  The
    `.partial` seen can still be renamed into place before the signal lands (a loaded machine):
    then the whole run is tried again in a fresh directory, so every caller gets a kill that left
    unfinished files behind.  Returns the journaled files."""
    for _ in range(5):
        finished = _kill_once(src, out, options, files, timeout)
        if any(out.glob("*.partial")):
            return finished
        shutil.rmtree(out)
    pytest.fail("five kills in a row landed between two files: none left a .partial")


def _kill_once(src: Path, out: Path, options: tuple[str, ...], files: int, timeout: float) -> list[str]:
    cmd = [sys.executable, "-m", "plamo2_tools.cli", "convert", str(src), str(out), *options, "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + timeout
    try:
        while len(journaled(out)) < files or not any(out.glob("*.partial")):
            if proc.poll() is not None:
                pytest.fail(f"convert ended (rc {proc.returncode}) before it could be killed: {proc.stderr.read()!r}")
            if time.monotonic() > deadline:
                pytest.fail("convert made no progress")
            time.sleep(0.001)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    assert not (out / MANIFEST_NAME).exists(), "the run finished before the kill: use a bigger checkpoint"
    return journaled(out)
