"""What each `export mlx` recipe costs in KL against the float64 reference (not a test).

    python bench/export_mlx_kl.py --out reports/export/kl

Synthesises two tiny checkpoints (PLaMo 2 `tiny` with a window wider than the prompts, so none of
mlx-lm's known PLaMo 2 differences but the dt clamp applies; PLaMo 3 `tiny3`), exports each with
every recipe below through the library (the same code as the CLI, plus per-module overrides that
plant bad recipes) and writes each export's record, verification included, as
OUT/<preset>-<recipe>.json (kind plamo2-export-mlx, which `plamo2-tools report` reads), with the
command that made it.  Synthetic random weights make these models far more sensitive to
quantization than trained ones: the numbers rank recipes, they do not predict a real model's KL.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

RECIPES: dict[str, dict[str, Any]] = {
    "float32": {},
    "bfloat16": {"dtype": "bfloat16"},
    "8bit": {"bits": 8},
    "8bit-out_proj-4bit": {"bits": 8, "overrides": {"*.mixer.out_proj": 4}},
    "8bit-out_proj-2bit": {"bits": 8, "overrides": {"*.mixer.out_proj": 2}},
    "4bit": {"bits": 4},
    "4bit-mixed": {"bits": 4, "mixed": True},
    "4bit-mixed-out_proj-2bit": {"bits": 4, "mixed": True, "overrides": {"*.mixer.out_proj": 2}},
}
CHECKPOINTS = {"tiny-wide": ("tiny", {"attention_window_size": 4096}), "tiny3": ("tiny3", {})}


def make_checkpoint(path: Path, preset: str, overrides: dict[str, Any]) -> None:
    from plamo2_tools.dtypes import FLOAT_DTYPES
    from plamo2_tools.model.registry import config_from_dict, family_of_preset
    from plamo2_tools.model.synth import random_tensor, write_checkpoint

    raw = {**family_of_preset(preset).preset_raw(preset), **overrides}
    cfg = config_from_dict(raw)
    write_checkpoint(path, cfg, lambda n, s: random_tensor(cfg, n, s, 0), FLOAT_DTYPES["float32"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    from plamo2_tools.convert.sources import open_source, source_side_files
    from plamo2_tools.dtypes import float_dtype
    from plamo2_tools.export.mlx import Recipe, export_mlx, verifier

    args.out.mkdir(parents=True, exist_ok=True)
    command = shlex.join([sys.executable, *sys.argv])
    with tempfile.TemporaryDirectory() as work:
        for ckpt_name, (preset, overrides) in CHECKPOINTS.items():
            src = Path(work) / ckpt_name
            make_checkpoint(src, preset, overrides)
            for name, spec in RECIPES.items():
                if "overrides" in spec and preset.startswith("tiny3"):
                    continue  # PLaMo 3 has no out_proj
                dtype = float_dtype(spec["dtype"]) if "dtype" in spec else None
                recipe = Recipe(
                    bits=spec.get("bits"),
                    mixed=spec.get("mixed", False),
                    dtype=dtype,
                    overrides=spec.get("overrides", {}),
                )
                source = open_source(src)
                try:
                    record = export_mlx(
                        source,
                        source_side_files(source),
                        Path(work) / f"{ckpt_name}-{name}",
                        recipe,
                        verify=verifier(src, recipe, source.config),
                    )
                finally:
                    source.close()
                record.update(
                    {"command": command, "checkpoint": f"{preset} {json.dumps(overrides)} seed 0", "recipe": spec}
                )
                (args.out / f"{ckpt_name}-{name}.json").write_text(json.dumps(record, indent=2) + "\n")
                v = record["verification"]
                print(ckpt_name, name, v["summary"], flush=True)


if __name__ == "__main__":
    main()
