"""Real lm-eval results JSON without a model: lm-eval 0.4.13's own gsm8k task config, pointed at a
self-written 3-problem fixture, evaluated through `simple_evaluate` with an oracle LM.

The committed fixtures under fixtures/lm-eval/ were written by `python tests/report/report_oracle.py`;
the test suite also runs one evaluation live, so a change in lm-eval's output shape shows up here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Self-written problems in the GSM8K schema (never the real data set in tests).  gsm8k is 5-shot,
# so the train split needs at least five problems to draw the few-shot examples from.
TRAIN = [
    ("Tom has 3 apples and buys 4 more. How many apples does he have?", "Tom has 3+4=<<3+4=7>>7 apples.\n#### 7"),
    ("A box holds 6 pens. How many pens are in 5 boxes?", "5 boxes hold 5*6=<<5*6=30>>30 pens.\n#### 30"),
    (
        "Ana reads 12 pages a day. How many pages does she read in 3 days?",
        "She reads 12*3=<<12*3=36>>36 pages.\n#### 36",
    ),
    ("A rope is 20 m long. 8 m are cut off. How long is the rest?", "The rest is 20-8=<<20-8=12>>12 m.\n#### 12"),
    (
        "Ben has 18 sweets and shares them with 2 friends equally, keeping none. How many does each friend get?",
        "Each friend gets 18/2=<<18/2=9>>9 sweets.\n#### 9",
    ),
]
TEST = [
    ("Mia buys 2 books at $7 each. How much does she pay?", "She pays 2*7=<<2*7=14>>14 dollars.\n#### 14"),
    (
        "A class has 25 pupils and 4 are absent. How many are present?",
        "25-4=<<25-4=21>>21 pupils are present.\n#### 21",
    ),
    ("A farmer has 9 hens laying 2 eggs each. How many eggs is that?", "9*2=<<9*2=18>>18 eggs.\n#### 18"),
]
# What a base model does when no stop string ends its answer (docs/eval.md §6): strict-match still
# finds the "#### N", flexible-extract takes the last number and misses.
RUN_ON = "<|plamo:bos|>Chapter 7 has 31 pages"


def write_data(directory: Path) -> dict[str, str]:
    directory.mkdir(parents=True, exist_ok=True)
    files = {}
    for split, rows in (("train", TRAIN), ("test", TEST)):
        path = directory / f"{split}.jsonl"
        path.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in rows))
        files[split] = str(path)
    return files


def task_config(data_files: dict[str, str], cache_dir: Path) -> dict[str, Any]:
    """The installed gsm8k.yaml with only the dataset keys changed (docs/eval.md §2, way 2); the
    datasets cache goes to cache_dir, not ~/.cache."""
    import lm_eval.tasks
    import yaml

    cfg = yaml.safe_load((Path(lm_eval.tasks.__file__).parent / "gsm8k" / "gsm8k.yaml").read_text())
    cfg.update(
        dataset_path="json", dataset_name=None, dataset_kwargs={"data_files": data_files, "cache_dir": str(cache_dir)}
    )
    return cfg


def oracle_lm(tp: int, pp: int, run_on_docs: frozenset[int] = frozenset()) -> Any:
    """An LM that answers with the gold solution; docs in run_on_docs keep talking past it."""
    from lm_eval.api.model import LM

    gold = {q: a for q, a in TEST}

    class OracleLM(LM):
        def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
            outputs = []
            for req in requests:
                answer = " " + gold[req.doc["question"]]
                if req.doc_id in run_on_docs:
                    answer += RUN_ON
                outputs.append(answer)
            return outputs

        def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list:
            raise NotImplementedError

        def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list:
            raise NotImplementedError

        def get_model_info(self) -> dict[str, Any]:
            # What our adapter records (merged into results["config"] by lm-eval).
            return {"tp": tp, "pp": pp, "shards": f"shards/tp{tp}pp{pp}", "dtype": "bfloat16"}

    return OracleLM()


def evaluate(
    data_dir: Path,
    tp: int = 1,
    pp: int = 1,
    limit: int | None = None,
    bootstrap_iters: int = 0,
    run_on_docs: frozenset[int] = frozenset(),
    output_path: Path | None = None,
) -> dict[str, Any]:
    """Run lm-eval; with output_path, write the results file exactly as the lm-eval CLI does."""
    import lm_eval
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.tasks import TaskManager

    tracker = EvaluationTracker(output_path=str(output_path)) if output_path else None
    res = lm_eval.simple_evaluate(
        model=oracle_lm(tp, pp, run_on_docs),
        model_args={"pretrained": f"shards/tp{tp}pp{pp}", "tp": tp, "pp": pp},
        tasks=[task_config(write_data(data_dir), data_dir / "cache")],
        task_manager=TaskManager(include_defaults=False),
        limit=limit,
        bootstrap_iters=bootstrap_iters,
        log_samples=True,
        evaluation_tracker=tracker,
    )
    samples = res.pop("samples")
    if tracker is not None:
        tracker.save_results_aggregated(results=res, samples=samples)
    return res


def main() -> None:
    """(Re)write the committed fixtures: three runs in lm-eval's own output layout."""
    import os
    import shutil

    here = Path(__file__).parent / "fixtures" / "lm-eval"
    shutil.rmtree(here, ignore_errors=True)
    os.chdir(here.parent)  # relative data_files keep absolute paths of this machine out of the fixtures
    data = Path("lm-eval-data")
    evaluate(data, 1, 1, bootstrap_iters=1000, run_on_docs=frozenset({1, 2}), output_path=Path("lm-eval/tp1pp1"))
    evaluate(data, 2, 2, run_on_docs=frozenset({0}), output_path=Path("lm-eval/tp2pp2"))
    evaluate(data, 1, 1, limit=2, output_path=Path("lm-eval/tp1pp1-limit"))
    shutil.rmtree(data)


if __name__ == "__main__":
    main()
