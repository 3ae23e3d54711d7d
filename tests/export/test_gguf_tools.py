"""llama.cpp's own tools on our files (`bench/llama_cpp.sh --tools` builds them from the same tree).

* `llama-perplexity --kl-divergence` reads the base file `kld-base` wrote and scores a GGUF against
  it: the KL, the base perplexity and the same-top-token rate it reports equal what we compute here
  from the same two distributions (llama.cpp's logits through llama-cpp-python, the base file's
  rows), and its report reads back with `read_kld_report`.  A base file one token off, or rows one
  position off, changes PPL(base) and the KL it reports.
* `export gguf --type q4_k_m` goes through `llama-quantize` on PATH, keeps the --tensor-type rules,
  records the type, verifies, and `check` re-derives what it can.

Seen failing: with the base file's stored tokens shifted by one (PPL(base) off by orders of magnitude),
with `--tensor-type` not passed on to llama-quantize (ffn_down not Q8_0).
"""

from __future__ import annotations

import json
import os
import subprocess

import gguf
import numpy as np
import pytest
from llama_cpp_env import TOOLS, needs_llama

from plamo2_tools.deploy.gguf import GGUFTarget
from plamo2_tools.deploy.kld import chunk_sequences, read_base, read_kld_report
from plamo2_tools.export.gguf import export_gguf, side_file

pytestmark = [
    pytest.mark.llama_cpp,
    pytest.mark.slow,
    needs_llama,
    pytest.mark.skipif(not (TOOLS / "llama-perplexity").is_file(), reason=f"no llama.cpp tools in {TOOLS}"),
]
N_CTX = 32
TEXT = " ".join(["the model writes", "日本語のテキスト", "tokens and more tokens", "PLaMo 3"] * 60)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64) - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def test_llama_perplexity_scores_a_gguf_against_our_base_file(cli, checkpoint, tmp_path) -> None:
    src = checkpoint("tiny3")
    model, base, text = tmp_path / "m.gguf", tmp_path / "base.kld", tmp_path / "t.txt"
    text.write_text(TEXT)
    export_gguf(src, model, "q8_0", verify=False)
    cli("kld-base", src, base, "--text", text, "--ctx", N_CTX, "--chunks", 4)
    # -fa off: llama-perplexity's default (auto) turns flash attention on, whose F16 attention moves the
    # mean KLD by ~1e-4 from what llama-cpp-python (flash attention off) gives on the same chunks.
    proc = subprocess.run(
        [
            str(TOOLS / "llama-perplexity"),
            "-m",
            str(model),
            "--kl-divergence-base",
            str(base),
            "--kl-divergence",
            "-c",
            str(N_CTX),
            "-b",
            str(N_CTX),
            "-t",
            "1",
            "-fa",
            "off",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = read_kld_report(proc.stdout + proc.stderr)
    # What llama-perplexity computed, computed here from the same distributions.
    kld = read_base(base)
    first, rows = N_CTX // 2, N_CTX - 1 - N_CTX // 2
    target = GGUFTarget(str(model), n_ctx=N_CTX)
    try:
        seqs = chunk_sequences(kld.tokens.tolist(), N_CTX, bos=1)
        kls, nll_base, nll_q, same = [], [], [], []  # per chunk
        for c, seq in enumerate(seqs):
            lq = _log_softmax(target.logits(seq))
            for per_chunk in (kls, nll_base, nll_q, same):
                per_chunk.append([])
            for i in range(rows):
                lp = kld.log_probs(c, i).astype(np.float64)
                keep = lp > -16
                kls[-1].append(float((np.exp(lp[keep]) * (lp[keep] - lq[first + i][keep])).sum()))
                nxt = kld.tokens[c * N_CTX + first + i + 1]
                nll_base[-1].append(-lp[nxt])
                nll_q[-1].append(-lq[first + i][nxt])
                same[-1].append(int(np.argmax(lp) == np.argmax(lq[first + i])))
    finally:
        target.close()
    # llama.cpp's logger can lose the last lines at exit (see read_kld_report): every chunk line that
    # was printed holds the running figures up to its chunk, and each is compared with ours.
    assert report["chunks_announced"] == 4 and len(kls) == 4
    assert [c["chunk"] for c in report["chunks"]] == list(range(1, len(report["chunks"]) + 1))
    assert report["chunks"], proc.stdout
    for line in report["chunks"]:
        n = line["chunk"]
        assert line["mean_kld"] == pytest.approx(np.mean(kls[:n]), abs=2e-5)
        assert line["same_top_p"] == pytest.approx(np.mean(same[:n]), abs=1e-3)
        assert line["ppl"] == pytest.approx(np.exp(np.mean(nll_q[:n])), rel=1e-3)
        assert line["ln_ppl_ratio"] == pytest.approx(np.mean(nll_q[:n]) - np.mean(nll_base[:n]), abs=1e-4)
    last = report["chunks"][-1]
    assert report["complete"] == (last["chunk"] == 4)
    # The base is the reference under the window convention llama.cpp follows (vLLM's): a q8_0 file is
    # then ~3e-4 nats away; under PFN's HF convention every position past tiny3's window differs (~0.1).
    assert last["mean_kld"] < 3e-3
    assert "Mean PPL(base)" not in report["statistics"]  # printed from 100 scored tokens on (here 4 x 15)


@pytest.fixture
def quantize_on_path(monkeypatch) -> None:
    monkeypatch.setenv("PATH", f"{TOOLS}{os.pathsep}{os.environ['PATH']}")


def test_a_k_quant_export_goes_through_llama_quantize(cli, checkpoint, tmp_path, quantize_on_path) -> None:
    src, out = checkpoint("tiny3"), tmp_path / "k.gguf"
    r = cli("export", "gguf", src, out, "--type", "q4_k_m", "--tensor-type", "ffn_down=q8_0", "--json", expect=None)
    assert r.exit_code in (0, 1), r.stderr
    record = json.loads(side_file(out).read_text())
    assert record["type"] == "q4_k_m" and record["tensor_types"] == ["ffn_down=q8_0"]
    assert record["verify"]["mean_kl"] >= 0
    reader = gguf.GGUFReader(str(out))
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    assert all(v == "Q8_0" for k, v in kinds.items() if "ffn_down" in k)
    assert json.loads(reader.fields["plamo2_tools.export"].contents())["type"] == "q4_k_m"
    del reader
    result = json.loads(cli("check", out, "--source", src, "--json").stdout)
    assert result["ok"] and result["tensors_compared"] > 0
