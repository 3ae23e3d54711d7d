"""`deploy/mlx.py:MLXTarget` on exported directories: the Target protocol as verify will use it
(detection, teacher-forced scores, mlx-lm's own greedy decode loop, tokenization, what it
declares), and its refusals.

Independent checks: the greedy tokens equal the argmax of the target's own teacher-forced forward
over prompt + continuation (mlx-lm's decode path with its caches against its prefill path), and
each step's log-probabilities equal that forward's row; scores are normalised and their
token_logprobs are the rows' entries at the next token.

Shown to fail: with `score` returning the rows one position later, the scores test went red;
with `greedy` recording each step's second-best token instead of mlx-lm's choice, the greedy test
went red; with `tokenize` adding special tokens (BOS), the tokenize test went red.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from plamo2_tools.deploy.target import detect_kind, open_target
from plamo2_tools.errors import Plamo2Error, UserError

WIDE = {"attention_window_size": 4096}


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory, checkpoint) -> Path:  # noqa: ANN001
    """tiny3-mqa exported at fp32 (no window crossed by the prompts below, no known difference)."""
    from typer.testing import CliRunner

    from plamo2_tools.cli import app

    out = tmp_path_factory.mktemp("mlx-target") / "mlx"
    r = CliRunner().invoke(app, ["export", "mlx", str(checkpoint("tiny3-mqa")), str(out), "--no-verify", "--json"])
    assert r.exit_code == 0, r.stderr
    return out


@pytest.mark.mlx
def test_detected_and_opened_as_an_mlx_target(exported: Path) -> None:
    assert detect_kind(str(exported)) == "mlx"
    target = open_target("mlx", str(exported))
    info = target.info()
    assert target.kind == "mlx" and target.full_logits and target.top_k == 0
    assert info["runtime"] == "mlx-lm" and info["model_type"] == "plamo3" and info["quantization"] is None
    assert info["vocab_size"] == 515 and info["dtype"] == "float32"
    assert [d["key"] for d in info["known_differences"]] == ["window_decode"]
    target.close()


@pytest.mark.mlx
def test_scores_are_normalised_rows_of_the_next_token(exported: Path, checkpoint) -> None:  # noqa: ANN001
    """Row i is the prediction made after reading ids[:i+1]: aligned with the reference's row i."""
    import torch

    from plamo2_tools.model.checkpoint import HFCheckpoint

    target = open_target("mlx", str(exported))
    seqs = [[1, 17, 300, 42, 99, 7], [1, 5, 6]]
    with HFCheckpoint(checkpoint("tiny3-mqa")) as ckpt:
        refs = [lg.double().log_softmax(-1).numpy() for lg in ckpt.family.reference_logits(ckpt, seqs, torch.float64)]
    for seq, s, ref in zip(seqs, target.score(seqs), refs, strict=True):
        np.testing.assert_allclose(s.logprobs, ref[: len(seq) - 1], atol=1e-4)
    for start in (0, 2):
        for seq, s in zip(seqs, target.score(seqs, start=start), strict=True):
            assert s.start == start and s.logprobs.shape == (len(seq) - 1 - start, 515)
            np.testing.assert_allclose(np.exp(s.logprobs).sum(-1), 1.0, rtol=1e-12)
            nxt = seq[start + 1 :]
            np.testing.assert_array_equal(s.token_logprobs, s.logprobs[np.arange(len(nxt)), nxt])
    full, later = target.score([seqs[0]])[0], target.score([seqs[0]], start=2)[0]
    np.testing.assert_array_equal(full.logprobs[2:], later.logprobs)


@pytest.mark.mlx
def test_greedy_follows_its_own_forward(exported: Path) -> None:
    target = open_target("mlx", str(exported))
    prompt = [1, 17, 300]  # prompt + 3 tokens stays inside the window of 6 (the decode convention)
    (cont,) = target.greedy([prompt], 3)
    assert len(cont.tokens) == 3 and cont.finish_reason == "length"
    (s,) = target.score([prompt + cont.tokens])
    rows = s.logprobs[len(prompt) - 1 :]
    assert cont.tokens == [int(r.argmax()) for r in rows]
    np.testing.assert_allclose(cont.logprobs, rows, atol=1e-4)
    np.testing.assert_allclose(cont.token_logprobs, [r[t] for r, t in zip(rows, cont.tokens, strict=True)], atol=1e-4)


@pytest.mark.mlx
def test_tokenize_is_the_native_tokenizer_without_special_tokens(exported: Path, checkpoint) -> None:  # noqa: ANN001
    from plamo2_tools.tokenizer import load_native

    target = open_target("mlx", str(exported))
    text = "Hello, MLX! 42"
    native = load_native(checkpoint("tiny3-mqa"))
    assert target.tokenize(text) == native(text, add_special_tokens=False)["input_ids"]


@pytest.mark.mlx
def test_refusals_are_one_line_errors(exported: Path, tmp_path: Path, private_copy) -> None:  # noqa: ANN001
    target = open_target("mlx", str(exported))
    with pytest.raises(UserError, match="outside the vocabulary"):
        target.score([[1, 515]])
    not_plamo = tmp_path / "llama"
    not_plamo.mkdir()
    (not_plamo / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (not_plamo / "model.safetensors").write_bytes(b"")
    with pytest.raises(Plamo2Error, match="llama"):
        open_target("mlx", str(not_plamo))
    damaged = private_copy(exported)
    with open(damaged / "model.safetensors", "r+b") as f:
        f.truncate(os.path.getsize(damaged / "model.safetensors") // 2)
    with pytest.raises(Plamo2Error, match="mlx-lm cannot load it"):
        open_target("mlx", str(damaged))


def test_without_mlx_the_target_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mlx", None)  # import mlx.core -> ImportError, as when not installed
    monkeypatch.setitem(sys.modules, "mlx.core", None)
    monkeypatch.delitem(sys.modules, "plamo2_tools.deploy.mlx", raising=False)
    with pytest.raises(UserError, match=r"plamo2-tools\[mlx\]"):
        open_target("mlx", str(tmp_path))
