"""Packed, chunked prefill (generation.PrefillGroup: several ragged prompts per forward, each cut
into chunks, forwards capped by a token budget) against one forward per prompt: the same
last-token logits and the same states (Mamba conv and SSM state, every KV row written) at fp32
rounding, on PLaMo 2 (with an SSD chunk of 8 tokens, so scan chunk boundaries fall inside
prompts and across prefill chunks) and PLaMo 3."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from plamo2_tools.model.registry import family_of
from plamo2_tools.model.synth import preset_config, random_tensor, write_checkpoint
from plamo2_tools.runtime.batching.engine import Runtime
from plamo2_tools.runtime.batching.generation import PrefillGroup, make_requests
from plamo2_tools.runtime.rank.comm import LocalWorld


@pytest.fixture(autouse=True)
def short_rank_timeouts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(LocalWorld, "TIMEOUT", 60.0)


# Shorter than a chunk (1, 3), several chunks (29, 40), a chunk boundary inside (17 = 8 + 8 + 1),
# exactly one chunk (8); 24-token forwards hold pieces of several prompts.
LENGTHS = [3, 29, 8, 1, 17, 40]
CHUNK, BUDGET = 8, 24


@pytest.fixture(scope="module")
def small_scan_shards(cli, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """tiny (PLaMo 2) with mamba_chunk_size 8, as TP1 and TP2 shards."""
    raw = {**family_of(preset_config("tiny")).preset_raw("tiny"), "mamba_chunk_size": 8}
    cfg = family_of(preset_config("tiny")).config(raw, "test")
    src = tmp_path_factory.mktemp("scan8") / "ckpt"
    write_checkpoint(src, cfg, lambda name, shape: random_tensor(cfg, name, shape, 4), torch.float32, tokenizer=False)
    out = {}
    for tp in (1, 2):
        dst = tmp_path_factory.mktemp(f"scan8-tp{tp}") / "shards"
        cli("convert", src, dst, "--tp", tp, "--json")
        out[f"tp{tp}"] = dst
    return out


def close(mine: torch.Tensor, ref: torch.Tensor) -> bool:
    """Equal at fp32 rounding: within 1e-5 of the reference's scale (packing changes the matmuls'
    row blocking and the chunking moves scan chunk boundaries: rounding, not math)."""
    return bool((mine - ref).abs().max() <= 1e-5 * ref.abs().max() + 1e-7)


def prefill_alone(eng, prompt: list[int]) -> tuple[torch.Tensor, dict]:
    states = eng.new_states(1, len(prompt))
    return eng._prefill([prompt], states, all_logits=False), states


def on_every_rank(rt: Runtime, fn):  # type: ignore[no-untyped-def]
    """fn(engine) on every rank at once (thread ranks meet in their collectives); rank 0's answer."""
    results, errors = [None] * len(rt.engines), []

    def run(r: int) -> None:
        try:
            results[r] = fn(rt.engines[r])
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
            rt.world.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(rt.engines))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results[0]


def compare(rt: Runtime, chunk: int | None, budget: int | None) -> int:
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, rt.config.vocab_size, (n,), generator=g).tolist() for n in LENGTHS]
    return on_every_rank(rt, lambda eng: compare_rank(eng, prompts, chunk, budget))


def compare_rank(eng, prompts: list[list[int]], chunk: int | None, budget: int | None) -> int:  # type: ignore[no-untyped-def]
    reqs = make_requests(prompts, [1] * len(prompts), 0, None)
    group = PrefillGroup(eng, reqs, chunk, budget)
    forwards = 0
    while group.ready() != list(range(len(reqs))):
        rows = group.next_forward()
        assert budget is None or sum(group._take(i) for i in range(*rows)) <= max(budget, chunk or 0)
        group.step(rows)
        forwards += 1
    last = eng.comm.info.is_last_stage
    for i, p in enumerate(prompts):
        logits, states = prefill_alone(eng, p)
        if last:
            assert close(group.logits[i], logits[0]), (i, len(p))
        for layer, st in states.items():
            packed = group.states[layer].tensors()
            for name, ref in st.tensors().items():
                mine = packed[name]
                if name in st.per_token:  # a KV cache: the prompt's positions, nothing past them
                    assert close(mine[i, : len(p)], ref[0, : len(p)]), (name, layer, i)
                    assert not mine[i, len(p) :].any()
                else:  # a fixed-size state (Mamba's conv and SSM)
                    assert close(mine[i], ref[0]), (name, layer, i)
    return forwards


@pytest.mark.parametrize("layout", ["tp1", "tp2"])
def test_packed_prefill_equals_one_prompt_per_forward_plamo2(small_scan_shards, layout) -> None:
    with Runtime(small_scan_shards[layout], backend="torch") as rt:
        assert rt.config.mamba_chunk_size == 8
        assert compare(rt, CHUNK, BUDGET) >= sum(LENGTHS) // BUDGET  # really several forwards
        compare(rt, None, BUDGET)  # whole prompts, packed up to the budget
        assert compare(rt, None, None) == 1  # everything in one forward


@pytest.mark.parametrize(
    ("preset", "tp", "pp"), [("tiny-gqa", 1, 1), ("tiny-gqa", 2, 2), ("tiny3", 1, 1), ("tiny3-mqa", 1, 2)]
)
def test_packed_prefill_equals_one_prompt_per_forward(shards, preset, tp, pp) -> None:
    with Runtime(shards(preset, tp, pp, seed=11), backend="torch") as rt:
        compare(rt, CHUNK, BUDGET)
        compare(rt, 5, 13)
