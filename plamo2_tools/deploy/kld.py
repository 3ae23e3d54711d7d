"""llama.cpp's KL-divergence base file, written from our reference forward, and what
`llama-perplexity --kl-divergence` says about a GGUF scored against it (docs/deploy.md, "GGUF").

The layout is the one `tools/perplexity/perplexity.cpp` writes with `--kl-divergence-base FILE`
(its `perplexity()` and `log_softmax(..., uint16_t * log_prob, ...)`) and reads back in
`kl_divergence()`, as of llama-cpp-python 0.3.36's vendored tree, all little-endian:

    "_logits_"                              8 bytes of magic
    n_ctx                                   uint32 (written from an int32)
    n_vocab, n_chunk                        int32 each
    tokens[n_chunk * n_ctx]                 int32: the tokenized text, as tokenized (see BOS below)
    per chunk, n_ctx - 1 - n_ctx/2 rows     one row per scored position p = n_ctx/2 .. n_ctx-2
      of nv = 2 * ((n_vocab + 1) / 2) + 4  uint16 each:
        float32 scale, float32 min_log_prob  (the row's first 4 uint16)
        q[n_vocab]                          log p(v) ~= scale * q[v] + min_log_prob; the last
                                            uint16 is padding (0) when n_vocab is odd

Each row quantizes the log-probabilities of the distribution at position p (which predicts token
p+1) over [max - 16, max] of the logits: min_logit = max(min, max - 16), scale = (max_logit -
min_logit) / 65535, q[v] = round((logit[v] - min_logit) / scale) for logit[v] > min_logit, else 0.
Only the second half of every chunk is scored (the model always has n_ctx/2 tokens of context).

BOS: llama-perplexity tokenizes the whole text once, with BOS in front when the GGUF says
`tokenizer.ggml.add_bos_token = true`, stores those tokens, and evaluates every chunk with its
first token replaced by BOS (so the stored tokens hold BOS only at index 0 of the first chunk while
every chunk ran with it).  `write_base` evaluates our reference the same way, so the base file
matches a `llama-perplexity --kl-divergence` run of a GGUF whose add_bos_token equals `add_bos`
(our exports write true; llama.cpp's own converter writes nothing, which means false).
"""

from __future__ import annotations

import math
import os
import re
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CheckpointError, UserError
from ..safe_files import create_fresh, write_error

MAGIC = b"_logits_"
HEADER = struct.Struct("<8sIii")  # magic, n_ctx, n_vocab, n_chunk
LOG_RANGE = 16.0  # nats below the top logit that a row resolves
KLD_BASE_KIND = "plamo2-kld-base"


def row_width(n_vocab: int) -> int:
    """uint16 per row: the two float32 (4 uint16) and n_vocab rounded up to even."""
    return 2 * ((n_vocab + 1) // 2) + 4


def scored_rows(n_ctx: int) -> int:
    return n_ctx - 1 - n_ctx // 2


def quantize_row(logits: np.ndarray) -> np.ndarray:
    """One row (row_width uint16) from one position's float32 logits, in float32 arithmetic as
    perplexity.cpp's `log_softmax(n_vocab, logits, log_prob, tok)` does it (the sum of exps in
    double, the rest in float; its nearest_int rounds ties to even, as np.rint)."""
    x = np.ascontiguousarray(logits, np.float32)
    n_vocab = x.size
    max_logit = x.max()
    min_logit = np.maximum(x.min(), np.float32(max_logit - np.float32(LOG_RANGE)))
    sum_exp = np.exp((x - max_logit).astype(np.float32), dtype=np.float32).astype(np.float64).sum()
    log_sum_exp = np.float32(math.log(sum_exp))
    min_log_prob = np.float32(np.float32(min_logit - max_logit) - log_sum_exp)
    scale = np.float32(np.float32(max_logit - min_logit) / np.float32(65535))
    row = np.zeros(row_width(n_vocab), np.uint16)
    row[:4] = np.array([scale, min_log_prob], np.float32).view(np.uint16)
    if scale:
        inv_scale = np.float32(1) / scale
        q = np.rint(inv_scale * (x - min_logit)).astype(np.float32)
        row[4 : 4 + n_vocab] = np.where(x > min_logit, q, 0).astype(np.uint16)
    return row


def dequantize_row(row: np.ndarray) -> np.ndarray:
    """Log-probabilities from one row, as kl_divergence() reads them (scale * q + min_log_prob)."""
    scale, min_log_prob = row[:4].view(np.float32)
    return scale * row[4:].astype(np.float32) + min_log_prob


@dataclass
class KLDBase:
    n_ctx: int
    n_vocab: int
    n_chunk: int
    tokens: np.ndarray  # int32 (n_chunk * n_ctx,)
    rows: np.ndarray  # uint16 (n_chunk, scored_rows(n_ctx), row_width(n_vocab))

    def log_probs(self, chunk: int, row: int) -> np.ndarray:
        return dequantize_row(self.rows[chunk, row])[: self.n_vocab]


def read_base(path: str | Path) -> KLDBase:
    """A base file, every size checked before anything is allocated (one line when it is not one)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(HEADER.size)
            if len(head) < HEADER.size:
                raise CheckpointError(f"{path}: truncated ({size} bytes): not a llama.cpp KL-divergence base file")
            magic, n_ctx, n_vocab, n_chunk = HEADER.unpack(head)
            if magic != MAGIC:
                raise CheckpointError(f"{path}: no {MAGIC.decode()} magic: not a llama.cpp KL-divergence base file")
            if n_ctx < 2 or n_vocab < 1 or n_chunk < 1:
                raise CheckpointError(f"{path}: impossible header n_ctx={n_ctx} n_vocab={n_vocab} n_chunk={n_chunk}")
            n_rows, width = scored_rows(n_ctx), row_width(n_vocab)
            expected = HEADER.size + 4 * n_chunk * n_ctx + 2 * n_chunk * n_rows * width
            if size != expected:
                raise CheckpointError(
                    f"{path}: {size} bytes, but its header (n_ctx={n_ctx}, n_vocab={n_vocab}, "
                    f"n_chunk={n_chunk}) means {expected}"
                )
            tokens = np.frombuffer(f.read(4 * n_chunk * n_ctx), "<i4").astype(np.int32)
            rows = np.frombuffer(f.read(), "<u2").reshape(n_chunk, n_rows, width).astype(np.uint16)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    return KLDBase(n_ctx, n_vocab, n_chunk, tokens, rows)


def chunk_sequences(tokens: Sequence[int], n_ctx: int, bos: int | None, chunks: int | None = None) -> list[list[int]]:
    """What llama-perplexity evaluates: n_ctx-token chunks, each with its first token replaced by BOS
    when the model adds one (bos is None otherwise)."""
    n_chunk = len(tokens) // n_ctx if chunks is None else min(chunks, len(tokens) // n_ctx)
    out = []
    for c in range(n_chunk):
        seq = [int(t) for t in tokens[c * n_ctx : (c + 1) * n_ctx]]
        if bos is not None:
            seq[0] = bos
        out.append(seq)
    return out


def write_base(
    path: Path,
    tokens: Sequence[int],
    n_ctx: int,
    n_vocab: int,
    bos: int | None,
    logits_of: Callable[[list[int]], np.ndarray],
    chunks: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Write the base file for `tokens` (the text as tokenized, BOS in front when added), each
    chunk evaluated by `logits_of` (the reference: (n_ctx, >= n_vocab) float logits).  Written as
    PATH.partial, created fresh, renamed at the end.  Returns the number of chunks."""
    seqs = chunk_sequences(tokens, n_ctx, bos, chunks)
    if not seqs:
        raise UserError(f"the text is {len(tokens)} tokens: one chunk needs n_ctx = {n_ctx} (use a smaller --ctx)")
    n_chunk = len(seqs)
    partial = path.with_name(path.name + ".partial")
    fd = create_fresh(partial, os.O_WRONLY)
    try:
        with os.fdopen(fd, "wb", closefd=False) as f:
            f.write(HEADER.pack(MAGIC, n_ctx, n_vocab, n_chunk))
            f.write(np.asarray(tokens[: n_chunk * n_ctx], dtype="<i4").tobytes())
            first = n_ctx // 2
            for seq in seqs:
                logits = np.asarray(logits_of(seq), dtype=np.float32)[:, :n_vocab]
                f.write(b"".join(quantize_row(logits[p]).astype("<u2").tobytes() for p in range(first, n_ctx - 1)))
                if progress:
                    progress(1)
            f.flush()
            os.fsync(fd)
    except OSError as e:
        os.close(fd)
        partial.unlink(missing_ok=True)
        raise write_error(e, path) from None
    except BaseException:
        os.close(fd)
        partial.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(partial, path)
    return n_chunk


# ---- llama-perplexity --kl-divergence's report -----------------------------------------------------
_STAT = re.compile(
    r"^(?P<name>[^:]+?)\s*:\s*(?P<value>-?[\d.]+(?:e[-+]?\d+)?|nan|inf)\s*(?:±\s*(?P<unc>-?[\d.]+))?\s*%?\s*$"
)
_ANNOUNCED = re.compile(r"computing over (\d+) chunks")
_CHUNK = re.compile(
    r"^\s*(\d+)\s+(-?[\d.]+)\s+±\s+(-?[\d.]+)\s+(-?[\d.]+)\s+±\s+(-?[\d.]+)\s+(-?[\d.]+)\s+±\s+"
    r"(-?[\d.]+)\s+(-?[\d.]+)\s+±\s+(-?[\d.]+)\s+%\s+(-?[\d.]+)\s+±\s+(-?[\d.]+)\s+%\s*$"
)


def read_kld_report(text: str) -> dict[str, Any]:
    """The figures of a `llama-perplexity --kl-divergence` run (its stdout/stderr as text): the
    statistics block (mean/median/percentile KLD, PPL ratio, Δp, same top p; printed from 100
    scored tokens on) and the per-chunk lines.  Percent figures as fractions.

    llama.cpp's tools log through a queue that a worker thread drains, and the queue is never flushed
    at exit (`common/log.cpp`: the main logger is never destroyed): the last lines of a run, a chunk
    line or the statistics, can be missing from what was captured.  `chunks_announced` (from
    "computing over N chunks") and `complete` say whether the figures cover the whole run; each
    per-chunk line holds the running figures up to that chunk, so a cut output is still right for
    the chunks it shows."""
    stats: dict[str, Any] = {}
    chunks = []
    announced = None
    for line in text.splitlines():
        a = _ANNOUNCED.search(line)
        if a:
            announced = int(a.group(1))
            continue
        m = _CHUNK.match(line)
        if m:
            v = [float(x) for x in m.groups()]
            chunks.append(
                {
                    "chunk": int(v[0]),
                    "ppl": v[1],
                    "ln_ppl_ratio": v[3],
                    "mean_kld": v[5],
                    "rms_dp": v[7] / 100,
                    "same_top_p": v[9] / 100,
                }
            )
            continue
        m = _STAT.match(line.strip())
        if m and ("KLD" in m["name"] or "PPL" in m["name"] or "Δp" in m["name"] or "top p" in m["name"]):
            value = float(m["value"])
            pct = line.rstrip().endswith("%")
            key = " ".join(m["name"].split())
            stats[key] = value / 100 if pct else value
            if m["unc"] is not None:
                stats[key + " ±"] = float(m["unc"]) / 100 if pct else float(m["unc"])
    if not stats and not chunks:
        raise UserError("no llama-perplexity --kl-divergence figures in this text")
    out: dict[str, Any] = {"kind": "llama-perplexity-kld", "statistics": stats, "chunks": chunks}
    last = chunks[-1] if chunks else {}
    out["chunks_announced"] = announced
    out["complete"] = announced is not None and last.get("chunk") == announced
    out["mean_kld"] = stats.get("Mean KLD", last.get("mean_kld"))
    out["same_top_p"] = stats.get("Same top p", last.get("same_top_p"))
    out["max_kld"] = stats.get("Maximum KLD")
    out["ppl_ratio"] = stats.get("Mean PPL(Q)/PPL(base)")
    return out


TEXT_BYTES = 256 * 2**20


def make_base(
    src: Path,
    out: Path,
    text: Path,
    n_ctx: int = 512,
    chunks: int | None = None,
    add_bos: bool | None = None,
    force: bool = False,
    device: str = "cpu",
    precision: str = "float64",
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """`plamo2-tools kld-base`: tokenize `text` with the checkpoint's tokenizer (PLaMo's native one),
    run the reference forward on every chunk as llama-perplexity would run the GGUF, write the
    base file.  `add_bos` defaults to the tokenizer's own rule (tokenizer_config.json)."""
    import torch

    from ..model.checkpoint import HFCheckpoint
    from ..safe_files import read_regular
    from ..tokenizer.loader import load_tokenizer

    if n_ctx < 4:
        raise UserError(f"--ctx {n_ctx}: must be >= 4")
    if precision not in ("float64", "float32"):  # float32: an 8B reference fits one 80 GB card
        raise UserError(f"--precision {precision!r}: float64 or float32")
    dtype = getattr(torch, precision)
    if out.is_symlink() or out.exists():
        if not force:
            raise UserError(f"{out}: exists (use --force to replace a KL-divergence base file)")
        if out.is_symlink() or not out.is_file():
            raise UserError(f"{out}: not a regular file: move it away")
        read_base(out)  # --force replaces only a base file (this refuses anything else in one line)
    try:
        body = read_regular(text, TEXT_BYTES).decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"--text {text}: not UTF-8 text") from None
    tokenizer = load_tokenizer(src)
    ids = list(tokenizer(body, add_special_tokens=False)["input_ids"])
    with HFCheckpoint(src) as ckpt:
        ckpt.check_inventory()
        cfg, family = ckpt.config, ckpt.family
        add = bool(getattr(tokenizer, "add_bos_token", False)) if add_bos is None else add_bos
        bos = cfg.bos_token_id if add else None
        if add and bos is None:
            raise UserError(f"{src}: --add-bos, but the config has no bos_token_id")
        tokens = ([bos] if bos is not None else []) + ids

        # The forward convention llama.cpp's graph follows (PLaMo 3: vLLM's window, W keys counting the
        # query): under PFN's HF one every position past the window would differ by construction.
        options = dict(family.gguf.reference_options) if family.gguf is not None else {}

        def logits_of(seq: list[int]) -> np.ndarray:
            return family.reference_logits(ckpt, [seq], dtype, device, **options)[0].double().numpy()

        n_chunk = write_base(out, tokens, n_ctx, cfg.vocab_size, bos, logits_of, chunks, progress)
    return {
        "kind": KLD_BASE_KIND,
        "file": str(out),
        "n_ctx": n_ctx,
        "n_vocab": cfg.vocab_size,
        "n_chunk": n_chunk,
        "tokens": len(tokens),
        "add_bos": bos is not None,
        "scored_per_chunk": scored_rows(n_ctx),
        "reference_precision": precision,
        "reference_options": options,
    }
