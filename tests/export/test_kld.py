"""`kld-base` (issue 30 §3): llama.cpp's --kl-divergence-base file from our reference forward.

The file is parsed here a second time, independently, the way `kl_divergence()` in llama.cpp's
tools/perplexity/perplexity.cpp reads it (field by field off a stream: magic, uint32 n_ctx, int32
n_vocab, int32 n_chunk, the tokens, then per chunk n_ctx - 1 - n_ctx/2 rows of 2*((n_vocab+1)/2)+4
uint16, each row's first two floats scale and min_log_prob, log p = scale*q + min_log_prob), and
compared with our reader field by field; the log-probabilities it holds are compared with the
reference forward's own log-softmax, computed here in float64 on each chunk as llama-perplexity
evaluates it (first token replaced by BOS), within the row's quantization step.

Seen failing: with the scored rows starting one position early (n_ctx/2 - 1), with n_ctx written
as int64, with every chunk's stored first token replaced by BOS (llama.cpp stores the text's
tokens), with min_log_prob lacking the log-sum-exp, with BOS substituted in the first chunk only.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from plamo2_tools.deploy.kld import read_base, read_kld_report
from plamo2_tools.errors import CheckpointError
from plamo2_tools.model.checkpoint import HFCheckpoint
from plamo2_tools.tokenizer.loader import load_tokenizer

N_CTX = 24
TEXT = " ".join(["the model writes", "日本語のテキスト", "tokens and more tokens", "PLaMo"] * 40)


def parse_like_perplexity_cpp(path: Path) -> dict:
    """kl_divergence()'s reads, in its order, from a stream."""
    with open(path, "rb") as f:
        assert f.read(8) == b"_logits_"
        (n_ctx,) = struct.unpack("<I", f.read(4))
        n_vocab, n_chunk = struct.unpack("<ii", f.read(8))
        tokens = list(struct.unpack(f"<{n_ctx * n_chunk}i", f.read(4 * n_ctx * n_chunk)))
        nv = 2 * ((n_vocab + 1) // 2) + 4
        rows = []
        for _ in range(n_chunk):
            chunk = []
            block = f.read(2 * (n_ctx - 1 - n_ctx // 2) * nv)
            for i in range(n_ctx - 1 - n_ctx // 2):
                row = block[2 * i * nv : 2 * (i + 1) * nv]
                scale, min_log_prob = struct.unpack("<ff", row[:8])
                q = struct.unpack(f"<{n_vocab}H", row[8 : 8 + 2 * n_vocab])
                chunk.append((scale, min_log_prob, q))
            rows.append(chunk)
        assert f.read() == b"", "bytes after the last row"
    return {"n_ctx": n_ctx, "n_vocab": n_vocab, "n_chunk": n_chunk, "tokens": tokens, "rows": rows}


@pytest.fixture(scope="module")
def base(cli, checkpoint, tmp_path_factory) -> tuple[Path, Path, Path]:
    src = checkpoint("tiny3")
    work = tmp_path_factory.mktemp("kld")
    text = work / "text.txt"
    text.write_text(TEXT)
    out = work / "base.kld"
    cli("kld-base", src, out, "--text", text, "--ctx", N_CTX, "--chunks", 3)
    return src, out, text


def test_our_reader_and_perplexity_cpp_reads_agree_field_by_field(base) -> None:
    _, out, _ = base
    ours, theirs = read_base(out), parse_like_perplexity_cpp(out)
    assert (ours.n_ctx, ours.n_vocab, ours.n_chunk) == (theirs["n_ctx"], theirs["n_vocab"], theirs["n_chunk"])
    assert (ours.n_ctx, ours.n_chunk) == (N_CTX, 3)
    assert ours.tokens.tolist() == theirs["tokens"]
    for c in range(ours.n_chunk):
        for i, (scale, min_log_prob, q) in enumerate(theirs["rows"][c]):
            row = ours.rows[c, i]
            assert row[:4].view(np.float32).tolist() == [scale, min_log_prob]
            assert row[4 : 4 + ours.n_vocab].tolist() == list(q)
            np.testing.assert_array_equal(ours.log_probs(c, i), scale * np.array(q, np.float32) + min_log_prob)


def test_tokens_are_the_text_as_llama_cpp_stores_them(base) -> None:
    src, out, text = base
    ids = load_tokenizer(src)(text.read_text(), add_special_tokens=False)["input_ids"]
    stored = read_base(out).tokens.tolist()
    assert stored == ([1] + list(ids))[: 3 * N_CTX]  # BOS once, in front of the text; never per chunk
    assert stored[N_CTX] != 1 and stored[2 * N_CTX] != 1


def test_rows_hold_the_reference_log_probabilities(base) -> None:
    """Each scored position against the reference's float64 log-softmax on the chunk as llama.cpp
    evaluates it: the chunk's first token replaced by BOS, PLaMo 3's window as llama.cpp's graph has it
    (vLLM's convention: W keys counting the query; seen failing with the base written under PFN's HF
    convention, the family's default)."""
    src, out, _ = base
    kld = read_base(out)
    first = N_CTX // 2
    with HFCheckpoint(src) as ckpt:
        options = {"window_convention": "vllm"} if ckpt.family.name == "plamo3" else {}
        for c in range(kld.n_chunk):
            seq = kld.tokens[c * N_CTX : (c + 1) * N_CTX].tolist()
            seq[0] = ckpt.config.bos_token_id
            logits = ckpt.family.reference_logits(ckpt, [seq], torch.float64, **options)[0].double()
            want = torch.log_softmax(logits, dim=-1).numpy()
            for i in range(N_CTX - 1 - first):
                p = first + i
                row = kld.rows[c, i]
                scale, min_log_prob = row[:4].view(np.float32)
                got = kld.log_probs(c, i)
                resolved = want[p] > min_log_prob + scale  # above the row's floor: quantized, not clipped
                assert resolved.sum() > 10
                err = np.abs(got[resolved] - want[p][resolved])
                assert err.max() <= scale / 2 + 1e-5, (c, p, err.max(), scale)
                assert np.all(got[~resolved] <= min_log_prob + scale + 1e-6)


def test_a_damaged_base_file_is_one_line(base, tmp_path) -> None:
    _, out, _ = base
    data = out.read_bytes()
    for name, body, says in (
        ("short", data[:10], "truncated"),
        ("magic", b"_logitz_" + data[8:], "magic"),
        ("cut", data[:-2], "bytes, but its header"),
    ):
        bad = tmp_path / name
        bad.write_bytes(body)
        with pytest.raises(CheckpointError, match=says):
            read_base(bad)


def test_kld_base_refuses_to_overwrite(cli, base, tmp_path, one_line_error) -> None:
    src, out, text = base
    other = tmp_path / "notes.txt"
    other.write_text("mine")
    r = cli("kld-base", src, other, "--text", text, "--ctx", N_CTX, "--force", expect=2)
    assert "not a llama.cpp KL-divergence base file" in one_line_error(r, 2) or "magic" in r.stderr
    assert other.read_text() == "mine"
    assert "exists" in one_line_error(cli("kld-base", src, out, "--text", text, expect=2), 2)


REPORT = Path(__file__).with_name("data") / "llama_perplexity_kld.txt"


@pytest.mark.skipif(not REPORT.is_file(), reason="no recorded llama-perplexity output")
def test_a_recorded_llama_perplexity_report_is_read() -> None:
    """A real `llama-perplexity --kl-divergence` run, recorded (llama-cpp-python 0.3.36's tools from
    bench/llama_cpp.sh --tools, CPU, -t 1 -fa off, -c 64: a tiny3 q8_0 export against our kld-base of
    tiny3, 4 chunks), so the reader is held to llama.cpp's real output where the tools are not built.
    The figures are the ones printed in the file, read by eye."""
    figures = read_kld_report(REPORT.read_text())
    assert [c["chunk"] for c in figures["chunks"]] == [1, 2, 3, 4]
    assert figures["chunks"][3]["mean_kld"] == pytest.approx(0.00032)
    assert figures["chunks"][3]["same_top_p"] == pytest.approx(0.94355)
    assert figures["mean_kld"] == pytest.approx(0.000316)
    assert figures["max_kld"] == pytest.approx(0.001030)
    assert figures["ppl_ratio"] == pytest.approx(0.999089)
    assert figures["same_top_p"] == pytest.approx(0.94355)  # a fraction, as the per-chunk column
