"""A job's result comes back from torchrun rank 0 as tensors + JSON, never as a pickle: what verify
and eval return survives the trip unchanged, and a result file cannot make the parent build
anything but the registered result types."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from plamo2_tools.eval.harness import EvalOutcome
from plamo2_tools.runtime.process.launch import load_result, save_result
from plamo2_tools.runtime.process.result_io import DATACLASS, tensors_path


def roundtrip(value: object, tmp_path: Path) -> object:
    path = tmp_path / "result"
    save_result(value, path)
    return load_result(path)


def test_verify_outputs_come_back_exactly(tmp_path: Path) -> None:
    """runtime_outputs: lists of tensors (some views of one buffer, some empty), token lists."""
    buffer = torch.randn(2, 7, 11)
    outputs = {
        "prompt_logits": [buffer[0], buffer[0, 1:3], buffer[1, 2:]],  # overlapping views of one buffer
        "tokens": [[5, 3, 3], []],
        "step_logits": [torch.randn(3, 11), torch.empty(0, 11)],
        "bf16": torch.randn(4, dtype=torch.bfloat16),
    }
    back = roundtrip(outputs, tmp_path)
    assert back.keys() == outputs.keys() and back["tokens"] == outputs["tokens"]
    for key in ("prompt_logits", "step_logits"):
        for a, b in zip(back[key], outputs[key], strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)
    assert back["bf16"].dtype == torch.bfloat16 and torch.equal(back["bf16"], outputs["bf16"])
    assert not list(tmp_path.glob("*.partial"))


def test_eval_outcome_and_json_corner_cases(tmp_path: Path) -> None:
    results = {
        "results": {"gsm8k": {"exact_match,strict-match": 0.5, "exact_match_stderr,strict-match": "N/A"}},
        "n-shot": {"gsm8k": 5},
        "odd keys": {1: "int key", ("a", 2): "tuple key", "$tensor": "a key that looks like a marker"},
        "tuple": (1, (2, "x"), [3]),
        "nan": math.nan,
        "numpy": np.float64(0.25),
        "numpy int": np.int64(7),
        "nothing": None,
    }
    outcome = EvalOutcome(results, {"gsm8k": [{"doc_id": 0, "resps": [["ans"]]}]}, {}, "head", "table")
    back = roundtrip(outcome, tmp_path)
    assert type(back) is EvalOutcome
    assert back.samples == outcome.samples and (back.header, back.table) == ("head", "table")
    got = back.results
    assert got["odd keys"] == results["odd keys"] and got["tuple"] == (1, (2, "x"), [3])
    assert math.isnan(got["nan"]) and got["numpy"] == 0.25 and got["numpy int"] == 7 and got["nothing"] is None
    assert {k: got[k] for k in ("results", "n-shot")} == {k: results[k] for k in ("results", "n-shot")}


def test_no_pickle_and_only_registered_types(tmp_path: Path) -> None:
    path = tmp_path / "result"
    save_result({"x": torch.ones(2), "o": EvalOutcome({}, {}, {}, "", "")}, path)
    json.loads(path.read_text())  # the structure is JSON ...
    raw = tensors_path(path).read_bytes()  # ... and the tensors safetensors: u64 header size, JSON header, data
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    assert header["t0"]["dtype"] == "F32" and header["t0"]["shape"] == [2]
    tree = json.loads(path.read_text())
    tree["o"][DATACLASS] = "subprocess:Popen"  # a result file naming a class of its own choosing
    path.write_text(json.dumps(tree))
    with pytest.raises(TypeError, match="not a registered result type"):
        load_result(path)

    @dataclass
    class Unregistered:
        x: int

    with pytest.raises(TypeError, match="not a registered result type"):
        save_result(Unregistered(1), tmp_path / "other")
