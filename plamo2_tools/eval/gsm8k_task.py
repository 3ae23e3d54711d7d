"""GSM8K from local files: where they are, whether they are the official ones, and lm-eval's own
gsm8k task (v3: prompt, filters, metrics) pointed at them.

The data is never part of this repository: it comes from ``--gsm8k-dir`` or ``$PLAMO2_GSM8K_DIR``
(openai/grade-school-math ``train.jsonl`` / ``test.jsonl``, MIT).  The sha256 check matters because
few-shot examples are drawn by position from the train split: a reordered or edited copy gives
different prompts and scores that do not compare with the reference.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ..digest import sha256_file
from ..errors import OutputExistsError, UserError

ENV_VAR = "PLAMO2_GSM8K_DIR"
# openai/grade-school-math grade_school_math/data at 3101c7d5 (docs/eval.md §2).
OFFICIAL_SHA256 = {
    "train": "17f347dc51477c50d4efb83959dbb7c56297aba886e5544ee2aaed3024813465",
    "test": "3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14",
}
SPLITS = ("train", "test")


@dataclass(frozen=True)
class Gsm8kData:
    files: dict[str, Path]  # split -> absolute path
    sha256: dict[str, str]
    verified: bool  # both files are the official ones

    def to_dict(self) -> dict[str, Any]:
        return {"files": {k: str(v) for k, v in self.files.items()}, "sha256": self.sha256, "verified": self.verified}


def resolve_gsm8k_dir(directory: str | Path | None) -> Path:
    """The flag's directory, else $PLAMO2_GSM8K_DIR; a clear error when neither is usable."""
    chosen = directory or os.environ.get(ENV_VAR)
    if not chosen:
        raise UserError(
            f"no GSM8K data: pass --gsm8k-dir DIR or set {ENV_VAR} to a directory holding "
            "train.jsonl and test.jsonl from openai/grade-school-math"
        )
    path = Path(chosen).expanduser().resolve()
    if not path.is_dir():
        raise UserError(f"GSM8K directory {path} does not exist")
    return path


def load_gsm8k_data(directory: str | Path | None, allow_unverified: bool = False) -> Gsm8kData:
    """Find train.jsonl / test.jsonl and check them against the official sha256 values."""
    root = resolve_gsm8k_dir(directory)
    files = {split: root / f"{split}.jsonl" for split in SPLITS}
    missing = [str(p) for p in files.values() if not p.is_file()]
    if missing:
        raise UserError(f"GSM8K file(s) missing: {', '.join(missing)}")
    digests = {split: sha256_file(path)[0] for split, path in files.items()}
    wrong = [
        f"{split}.jsonl sha256 {digests[split][:12]}… (official {OFFICIAL_SHA256[split][:12]}…)"
        for split in SPLITS
        if digests[split] != OFFICIAL_SHA256[split]
    ]
    if wrong and not allow_unverified:
        raise UserError(
            f"{root} does not hold the official GSM8K files: {'; '.join(wrong)}. Scores would not "
            "compare with published numbers; pass --allow-unverified-data to run anyway"
        )
    for split in SPLITS:
        if digests[split] != OFFICIAL_SHA256[split]:  # the official files are known good
            check_records(files[split])
    return Gsm8kData(files, digests, verified=not wrong)


def check_records(path: Path) -> None:
    """Every line a JSON object with "question" and "answer" strings, as in openai/grade-school-math:
    anything else would fail deep inside the datasets library with a long chained traceback."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise UserError(f"{path}: not UTF-8 text, so not GSM8K JSON lines") from None
    records = 0
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}: line {number} is not JSON ({e.msg}); GSM8K is one JSON object a line") from None
        if not (isinstance(row, dict) and isinstance(row.get("question"), str) and isinstance(row.get("answer"), str)):
            raise UserError(f'{path}: line {number} is not a GSM8K record (needs "question" and "answer" strings)')
        records += 1
    if not records:
        raise UserError(f"{path}: no GSM8K records (the file is empty)")


def installed_task_yaml(name: str = "gsm8k") -> Path:
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent / "gsm8k" / f"{name}.yaml"


def gsm8k_task_config(data: Gsm8kData) -> dict[str, Any]:
    """The installed gsm8k.yaml with only the dataset keys changed (docs/eval.md §2, way 2): a
    complete task config for ``simple_evaluate(tasks=[cfg])``; results still come out as gsm8k v3."""
    cfg = yaml.safe_load(installed_task_yaml().read_text())
    cfg = copy.deepcopy(cfg)
    cfg.update(
        dataset_path="json",
        dataset_name=None,
        dataset_kwargs={"data_files": {split: str(path) for split, path in data.files.items()}},
    )
    return cfg


def write_task_yaml(data: Gsm8kData, directory: str | Path) -> Path:
    """The same config as a YAML for lm-eval's own CLI: ``--include_path DIRECTORY --tasks gsm8k``
    (same task name, so it replaces the built-in, Hub-backed one)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "gsm8k.yaml"
    header = (
        "# lm-eval's gsm8k.yaml (lm-evaluation-harness, MIT) with the dataset keys pointed at local files.\n"
        "# Written by plamo2-tools; GSM8K data: openai/grade-school-math (MIT).\n"
    )
    if path.exists() and "Written by plamo2-tools" not in path.read_text(errors="replace")[: len(header)]:
        raise OutputExistsError(f"{path} exists and was not written by plamo2-tools; move it away first")
    path.write_text(header + yaml.safe_dump(gsm8k_task_config(data), sort_keys=False, allow_unicode=True))
    return path
