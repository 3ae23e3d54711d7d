"""Benchmark the native PLaMo tokenizer against PLaMo's own ``tokenization_plamo.py`` + numba (not a test).

    python bench/tokenizer.py --original DIR [--vocab DIR | --substring-vocab] [--gsm8k-dir DIR] [--out FILE.json]

Texts: lm-eval's GSM8K 5-shot prompts (its own gsm8k task, fewshot from train, 1319 contexts) and
the test set's questions and answers, read from ``--gsm8k-dir`` or ``$PLAMO2_GSM8K_DIR`` (never
copied here).  Vocabulary: ``--vocab DIR`` (a checkpoint directory with tokenizer.jsonl), else a
synthetic one of PLaMo 2's size (100000 rows) written to a temporary directory; ``--substring-vocab``
builds a worst case instead (pieces running across word boundaries leave the native tokenizer
almost nothing to split at).  Results go to ``--out`` (default reports/tokenizer/bench_tokenizer.json).  The original is
imported from ``--original DIR/tokenization_plamo.py`` (a real checkpoint holds it; it is someone
else's code and stays outside this repository) and needs numba.

Measured in one process, interleaved so that a noisy neighbour slows both alike, CPU time
(process_time) and wall time: loading each tokenizer; the original's first call (numba's JIT
compile) apart; the bare encoders (``AhoCorasick.encode`` vs ``PlamoEncoder.encode``); and the
tokenizer call users make (``tokenizer(texts)["input_ids"]``, batched as lm-eval does).  The
native tokenizer is timed cold (its cache and suffix states emptied before every repetition,
i.e. as on a first run) and warm (the same texts again).  Every text's ids are compared.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

KIND = "plamo2-bench-tokenizer"
SCHEMA_VERSION = 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--original", type=Path, help="directory holding PLaMo's tokenization_plamo.py (needs numba)")
    ap.add_argument("--vocab", type=Path, help="tokenizer directory (tokenizer.jsonl + config); default: synthetic")
    ap.add_argument(
        "--substring-vocab",
        action="store_true",
        help="instead: 100000 rows of the most frequent substrings (up to 12 characters, across word "
        "boundaries) of GSM8K's train split, the worst case for the native tokenizer's splitting",
    )
    ap.add_argument("--gsm8k-dir", type=Path, help="train.jsonl / test.jsonl (default: $PLAMO2_GSM8K_DIR)")
    ap.add_argument("--repeat", type=int, default=3, help="timed repetitions of each measurement")
    ap.add_argument("--limit", type=int, help="only the first N prompts and test documents (a quick look)")
    ap.add_argument("--out", type=Path, default=Path("reports/tokenizer/bench_tokenizer.json"))
    args = ap.parse_args()

    started = time.time()
    texts, data_info = gsm8k_texts(args.gsm8k_dir, args.limit)
    with tempfile.TemporaryDirectory() as tmp:
        if args.substring_vocab:
            vocab_dir, vocab_info = substring_vocabulary(args.gsm8k_dir, Path(tmp))
        else:
            vocab_dir, vocab_info = vocabulary(args.vocab, Path(tmp))
        report: dict[str, Any] = {
            "kind": KIND,
            "schema_version": SCHEMA_VERSION,
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "machine": machine(),
            "data": data_info,
            "vocab": vocab_info,
        }
        native, report["native"] = load_native(vocab_dir)
        original, report["original"] = load_original(args.original, vocab_dir)
        report["results"] = {name: measure(native, original, group, args.repeat) for name, group in texts.items()}
    report["summary"] = summary(report)
    report["machine"]["loadavg_end"] = list(os.getloadavg())
    report["seconds"] = round(time.time() - started, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    print(json.dumps(report["summary"], indent=1))
    print(f"wrote {args.out}")


# ---- inputs ---------------------------------------------------------------------------------------
def gsm8k_texts(directory: Path | None, limit: int | None) -> tuple[dict[str, list[str]], dict[str, Any]]:
    """lm-eval's gsm8k 5-shot contexts, and the test questions and answers."""
    from lm_eval.api.task import ConfigurableTask

    from plamo2_tools.eval.gsm8k_task import gsm8k_task_config, load_gsm8k_data

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    data = load_gsm8k_data(directory, allow_unverified=True)
    start = time.perf_counter()
    task = ConfigurableTask(config=gsm8k_task_config(data))
    task.build_all_requests(rank=0, world_size=1, limit=limit)
    prompts = [inst.args[0] for inst in task.instances]
    docs = [json.loads(line) for line in data.files["test"].read_text().splitlines() if line.strip()]
    docs = docs[:limit] if limit else docs
    test = [text for doc in docs for text in (doc["question"], doc["answer"])]
    info = {
        **data.to_dict(),
        "prompt_build_s": round(time.perf_counter() - start, 2),
        "prompts": len(prompts),
        "test_texts": len(test),
    }
    return {"gsm8k_5shot_prompts": prompts, "gsm8k_test": test}, info


def vocabulary(directory: Path | None, tmp: Path) -> tuple[Path, dict[str, Any]]:
    from plamo2_tools.tokenizer import write_synthetic_tokenizer

    if directory is None:
        directory = write_synthetic_tokenizer(tmp / "vocab", vocab_size=100_032, seed=0)
        source = "synthetic: write_synthetic_tokenizer(vocab_size=100032, seed=0)"
    else:
        source = str(directory)
    path = directory / "tokenizer.jsonl"
    rows = sum(1 for _ in path.open(encoding="utf-8"))
    return directory, {"source": source, "rows": rows, "sha256": sha256(path)}


def substring_vocabulary(gsm8k_dir: Path | None, tmp: Path) -> tuple[Path, dict[str, Any]]:
    """PLaMo-format rows whose pieces are GSM8K train substrings, scored by log frequency."""
    import math
    from collections import Counter

    from plamo2_tools.eval.gsm8k_task import load_gsm8k_data
    from plamo2_tools.tokenizer.synthetic import CONTROL_TOKENS, tokenizer_config

    data = load_gsm8k_data(gsm8k_dir, allow_unverified=True)
    docs = [json.loads(line) for line in data.files["train"].read_text().splitlines() if line.strip()][:3000]
    corpus = "\n".join(d["question"] + "\n" + d["answer"] for d in docs)
    counts: Counter[str] = Counter(corpus[i : i + n] for i in range(len(corpus)) for n in range(1, 13))
    items = sorted(((p, c) for p, c in counts.items() if c >= 2 or len(p) == 1), key=lambda x: -x[1] * len(x[0]) ** 0.5)
    rows: list[list[Any]] = [[CONTROL_TOKENS[0], 0.0, "UNKNOWN"]] + [[t, 0.0, "CONTROL"] for t in CONTROL_TOKENS[1:]]
    rows += [[f"<0x{b:02X}>", 0.0, "BYTE"] for b in range(256)]
    total = sum(c for _, c in items[: 100_000 - len(rows)])
    rows += [[p, round(math.log(c / total), 6), "NORMAL"] for p, c in items[: 100_000 - len(rows)]]
    directory = tmp / "substring-vocab"
    directory.mkdir(parents=True)
    with (directory / "tokenizer.jsonl").open("w", encoding="utf-8") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(True)))
    path = directory / "tokenizer.jsonl"
    source = "substrings of GSM8K train[:3000] (--substring-vocab)"
    return directory, {"source": source, "rows": len(rows), "sha256": sha256(path)}


def load_native(directory: Path) -> tuple[Any, dict[str, Any]]:
    from plamo2_tools.tokenizer import load_native as load

    cpu, wall, tok = timed(lambda: load(directory))
    return tok, {"class": type(tok).__name__, "load_cpu_s": cpu, "load_wall_s": wall}


def load_original(directory: Path | None, vocab_dir: Path) -> tuple[Any, dict[str, Any] | None]:
    """PLaMo's Plamo2Tokenizer from DIR/tokenization_plamo.py, built from the same files."""
    if directory is None:
        return None, None
    source = directory / "tokenization_plamo.py"
    spec = importlib.util.spec_from_file_location("tokenization_plamo", source)
    assert spec is not None and spec.loader is not None, source
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # imports numba
    import numba

    cpu, wall, tok = timed(lambda: module.Plamo2Tokenizer.from_pretrained(str(vocab_dir)))
    jit_cpu, jit_wall, _ = timed(lambda: tok.aho_corasick.encode("warm up"))  # the first call compiles
    return tok, {
        "file": str(source),
        "sha256": sha256(source),
        "numba": numba.__version__,
        "load_cpu_s": cpu,
        "load_wall_s": wall,
        "jit_compile_cpu_s": jit_cpu,
        "jit_compile_wall_s": jit_wall,
    }


# ---- measurements ---------------------------------------------------------------------------------
def measure(native: Any, original: Any, texts: list[str], repeat: int) -> dict[str, Any]:
    """Interleaved repetitions of every measurement on one group of texts; ids compared once."""
    encoder = native.encoder
    runs: dict[str, list[tuple[float, float]]] = {}

    def run(name: str, fn: Callable[[], Any], before: Callable[[], None] | None = None) -> Any:
        if before is not None:
            before()
        cpu, wall, out = timed(fn)
        runs.setdefault(name, []).append((cpu, wall))
        return out

    def cold() -> None:
        encoder._cache.clear()
        encoder._reset_states()

    for _ in range(repeat):
        if original is not None:
            orig_core = run("original_encoder", lambda: [original.aho_corasick.encode(t).tolist() for t in texts])
            orig_call = run("original_call", lambda: original(texts)["input_ids"])
        native_core = run("native_encoder_cold", lambda: [encoder.encode(t) for t in texts], before=cold)
        run("native_encoder_warm", lambda: [encoder.encode(t) for t in texts])
        native_call = run("native_call_cold", lambda: native(texts)["input_ids"], before=cold)
        run("native_call_warm", lambda: native(texts)["input_ids"])
    chars = sum(map(len, texts))
    result: dict[str, Any] = {
        "texts": len(texts),
        "chars": chars,
        "tokens": sum(map(len, native_core)),
        "runs": {
            name: {"cpu_s": [round(c, 4) for c, _ in v], "wall_s": [round(w, 4) for _, w in v]}
            for name, v in runs.items()
        },
        "median_cpu_ns_per_char": {
            name: round(statistics.median(c for c, _ in v) / chars * 1e9, 1) for name, v in runs.items()
        },
    }
    if original is not None:
        result["encoder_mismatches"] = sum(a != b for a, b in zip(orig_core, native_core, strict=True))
        result["call_mismatches"] = sum(a != b for a, b in zip(orig_call, native_call, strict=True))
        first = next((i for i, (a, b) in enumerate(zip(orig_call, native_call, strict=True)) if a != b), None)
        result["first_mismatch"] = None if first is None else {"index": first, "text": texts[first][:200]}
    return result


def summary(report: dict[str, Any]) -> dict[str, Any]:
    """Speed ratios (original time / native time, >1 = native faster) from median CPU times."""
    out: dict[str, Any] = {"native_load_s": report["native"]["load_cpu_s"]}
    if report["original"]:
        out["original_load_s"] = report["original"]["load_cpu_s"]
        out["original_jit_compile_s"] = report["original"]["jit_compile_cpu_s"]
    for group, r in report["results"].items():
        med = r["median_cpu_ns_per_char"]
        entry: dict[str, Any] = {"ns_per_char": med}
        if "original_encoder" in med:
            entry["encoder_speedup_cold"] = round(med["original_encoder"] / med["native_encoder_cold"], 2)
            entry["encoder_speedup_warm"] = round(med["original_encoder"] / med["native_encoder_warm"], 2)
            entry["call_speedup_cold"] = round(med["original_call"] / med["native_call_cold"], 2)
            entry["call_speedup_warm"] = round(med["original_call"] / med["native_call_warm"], 2)
            entry["identical_ids"] = r["encoder_mismatches"] == 0 and r["call_mismatches"] == 0
        out[group] = entry
    return out


# ---- helpers --------------------------------------------------------------------------------------
def timed(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """CPU seconds of this process (what contention on a shared machine inflates least), wall seconds."""
    cpu, wall = time.process_time(), time.perf_counter()
    out = fn()
    return round(time.process_time() - cpu, 4), round(time.perf_counter() - wall, 4), out


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def machine() -> dict[str, Any]:
    import numpy
    import transformers

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "transformers": transformers.__version__,
        "loadavg_start": list(os.getloadavg()),
    }


if __name__ == "__main__":
    main()
