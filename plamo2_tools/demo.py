"""`plamo2-tools demo`: the main job end to end on an embedded default, for a first run on any
machine: a synthetic checkpoint -> convert to several TP x PP layouts -> check -> verify."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .convert.engine import convert
from .model.synth import preset_config, synth
from .shards.check import check_shards
from .verify import random_prompts, verify

DEFAULT_LAYOUTS = ((1, 1), (2, 1), (2, 2))


def run_demo(
    workdir: Path,
    preset: str = "tiny",
    layouts: tuple[tuple[int, int], ...] = DEFAULT_LAYOUTS,
    launch: bool = False,
    max_new_tokens: int = 16,
    log: Any = print,
) -> dict[str, Any]:
    src = workdir / f"{preset}-hf"
    if not (src / "config.json").exists():
        log(f"1. synth: random {preset} checkpoint -> {src}")
        synth(src, preset, seed=0, force=True)
    else:
        log(f"1. synth: reusing {src}")
    cfg = preset_config(preset)
    shard_dirs = []
    for tp, pp in layouts:
        out = workdir / f"{preset}-tp{tp}-pp{pp}"
        result = convert(src, out, tp=tp, pp=pp, force=True)
        check = check_shards(out)
        log(
            f"2. convert tp={tp} pp={pp}: {result.status}, {len(result.plan.files)} file(s); "
            f"check: {'ok' if check.ok else check.checks}"
        )
        shard_dirs.append(out)
    prompts = random_prompts(4, cfg.vocab_size, seed=0, bos=cfg.bos_token_id)
    log(
        f"3. verify {len(shard_dirs)} layout(s) against the reference forward "
        f"({len(prompts)} prompts, {max_new_tokens} greedy steps)"
    )
    return verify(shard_dirs, src, prompts, "random(n=4, seed=0)", max_new_tokens, launch=launch, backend="auto")
