"""The runtime runs PLaMo 3 shards at every valid layout of the tiny presets exactly like the
reference forward: fp32 logits within 1e-4 relative and identical greedy tokens, with prompts both
shorter than the window (so decode crosses it) and longer; in both window conventions; on threads
and on real torchrun ranks."""

from __future__ import annotations

import pytest
import torch

from plamo2_tools.model.plamo3 import FAMILY
from plamo2_tools.model.registry import valid_layouts
from plamo2_tools.model.synth import preset_config
from plamo2_tools.runtime.batching.engine import Runtime
from plamo2_tools.runtime.process.jobs import run_job
from plamo2_tools.verify import THRESHOLDS, compare, judge, random_prompts, reference_outputs, runtime_outputs

STEPS = 24
_REFERENCE: dict[tuple[str, str], object] = {}


def _prompts(preset: str) -> list[list[int]]:
    cfg = preset_config(preset)
    short = random_prompts(2, cfg.vocab_size, seed=31, lengths=(2, 3))  # below every tiny window: decode crosses it
    long = random_prompts(2, cfg.vocab_size, seed=32, lengths=(12, 30))
    return short + long


def _reference(checkpoint, preset: str, convention: str):
    key = (preset, convention)
    if key not in _REFERENCE:
        _REFERENCE[key] = reference_outputs(
            checkpoint(preset, seed=9),
            _prompts(preset),
            STEPS,
            torch.float64,
            forward_options={"window_convention": convention},
        )
    return _REFERENCE[key]


LAYOUTS = [(p, tp, pp) for p in FAMILY.tiny_presets for tp, pp in valid_layouts(preset_config(p), 8)]


@pytest.mark.parametrize("preset, tp, pp", LAYOUTS, ids=[f"{p}-tp{t}-pp{q}" for p, t, q in LAYOUTS])
def test_every_layout_matches_the_reference(shards, checkpoint, preset: str, tp: int, pp: int) -> None:
    ref = _reference(checkpoint, preset, "hf")
    with Runtime(shards(preset, tp, pp, seed=9), backend="torch", mode="local") as rt:
        metrics = compare(ref, runtime_outputs(rt, _prompts(preset), STEPS))
    assert not judge(metrics, THRESHOLDS["float32"]), metrics


@pytest.mark.parametrize("preset", FAMILY.tiny_presets)
def test_the_vllm_convention_matches_its_reference(shards, checkpoint, preset: str) -> None:
    ref_vllm, ref_hf = _reference(checkpoint, preset, "vllm"), _reference(checkpoint, preset, "hf")
    options = {"window_convention": "vllm"}
    with Runtime(shards(preset, 2, 2, seed=9), backend="torch", mode="local", forward_options=options) as rt:
        out = runtime_outputs(rt, _prompts(preset), STEPS)
    assert not judge(compare(ref_vllm, out), THRESHOLDS["float32"])
    assert judge(compare(ref_hf, out), THRESHOLDS["float32"]), "the conventions must not agree past the window"


def test_an_unknown_window_convention_is_one_line(shards) -> None:
    from plamo2_tools.errors import UserError

    with pytest.raises(UserError, match="window_convention 'w' is not one of hf, vllm"):
        Runtime(shards("tiny3", 1, 1, seed=9), forward_options={"window_convention": "w"})


@pytest.mark.slow
def test_torchrun_ranks_equal_threads(shards) -> None:
    path = shards("tiny3-yarn", 2, 2, seed=9)
    prompts = _prompts("tiny3-yarn")[:2]
    runtime = {"shards": str(path), "device": "cpu", "backend": "torch"}
    dist = run_job(runtime_outputs, runtime, {"prompts": prompts, "max_new_tokens": 6}, launch=True)
    with Runtime(path, backend="torch", mode="local") as rt:
        local = runtime_outputs(rt, prompts, 6)
    assert dist["tokens"] == local["tokens"]
    for a, b in zip(dist["prompt_logits"], local["prompt_logits"], strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-5)


def test_scale_embedding_runs_as_the_reference(tmp_path) -> None:
    from plamo2_tools.convert.engine import convert
    from plamo2_tools.model import config_from_dict
    from plamo2_tools.model.synth import random_tensor, write_checkpoint
    from plamo2_tools.verify import verify

    cfg = config_from_dict(FAMILY.preset_raw("tiny3") | {"scale_embedding": True})
    src = tmp_path / "scaled"
    write_checkpoint(src, cfg, lambda n, s: random_tensor(cfg, n, s, 5), torch.float32, tokenizer=False)
    convert(src, tmp_path / "tp2", tp=2)
    result = verify([tmp_path / "tp2"], src, _prompts("tiny3"), "test", 8, backend="torch")
    assert result["passed"], result["layouts"][0]["failures"]
