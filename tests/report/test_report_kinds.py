"""The report recognises our files by their "kind" and "schema_version" only: what every writer
writes is read, a key set that merely looks like ours is not, an unknown version is skipped with a
note; and every committed result under reports/ is recognised."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import pytest

from bench import BENCHMARKS
from bench import load as load_benchmark
from plamo2_tools import kinds
from plamo2_tools.kinds import (
    BENCH_KERNELS_KIND,
    CHECK_KIND,
    CHECK_SCHEMA_VERSION,
    CONVERT_KIND,
    CONVERT_SCHEMA_VERSION,
    EVAL_KIND,
    EVAL_SCHEMA_VERSION,
    INSPECT_KIND,
    INSPECT_SCHEMA_VERSION,
    VERIFY_KIND,
    VERIFY_SCHEMA_VERSION,
)
from plamo2_tools.report import build_report
from plamo2_tools.report.inputs import SCHEMAS, classify, collect, load

ROOT = Path(__file__).resolve().parents[2]
WRITERS = {  # kind -> the version its writer writes today
    CONVERT_KIND: CONVERT_SCHEMA_VERSION,
    CHECK_KIND: CHECK_SCHEMA_VERSION,
    INSPECT_KIND: INSPECT_SCHEMA_VERSION,
    VERIFY_KIND: VERIFY_SCHEMA_VERSION,
    EVAL_KIND: EVAL_SCHEMA_VERSION,
    kinds.EXPORT_FP8_KIND: kinds.EXPORT_FP8_SCHEMA_VERSION,
    kinds.EXPORT_MLX_KIND: kinds.EXPORT_MLX_SCHEMA_VERSION,
    kinds.EXPORT_GGUF_KIND: kinds.EXPORT_GGUF_SCHEMA_VERSION,
    kinds.VERIFY_TARGETS_KIND: kinds.VERIFY_TARGETS_SCHEMA_VERSION,
}


def module_constants(path: Path) -> dict[str, Any]:
    """Module-level NAME = literal assignments of a script (`A, B = 1, 2` too), read without importing it."""
    out = {}
    for node in ast.parse(path.read_text()).body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1):
            continue
        target = node.targets[0]
        try:
            value = ast.literal_eval(node.value)
        except ValueError:
            continue
        if isinstance(target, ast.Name):
            out[target.id] = value
        elif isinstance(target, ast.Tuple) and all(isinstance(e, ast.Name) for e in target.elts):
            out.update(zip((e.id for e in target.elts), value, strict=True))  # type: ignore[attr-defined]
    return out


def test_every_writer_is_read_in_the_version_it_writes() -> None:
    for kind, version in WRITERS.items():
        assert version in SCHEMAS[kind].versions, kind
    assert len(set(WRITERS)) == len(WRITERS)


# Scripts under bench/ that are not suite benchmarks and spell their kind out (module constants).
SCRIPTS = {  # script -> (kind constant, version constant) as it names them
    "vllm_compat.py": ("KIND", "VERSION"),
    "plamo3_vllm_forward.py": ("KIND", "SCHEMA_VERSION"),
    "kill_resume.py": ("KIND", "SCHEMA_VERSION"),
    "tokenizer.py": ("KIND", "SCHEMA_VERSION"),
    "mutants.py": ("KIND", "SCHEMA_VERSION"),
    "startup.py": ("KIND", "SCHEMA_VERSION"),
    "load.py": ("KIND", "SCHEMA_VERSION"),
    "lm_eval_parts.py": ("KIND", "SCHEMA_VERSION"),
    "export_fp8.py": ("KIND", "SCHEMA_VERSION"),
    "export_mlx.py": ("KIND", "SCHEMA_VERSION"),
}
SCRIPT_KINDS = {  # what kinds.py says they write
    "vllm_compat.py": (kinds.VLLM_COMPAT_KIND, kinds.VLLM_COMPAT_SCHEMA_VERSION),
    "plamo3_vllm_forward.py": (kinds.VLLM_FORWARD_KIND, kinds.VLLM_FORWARD_SCHEMA_VERSION),
    "kill_resume.py": (kinds.KILL_RESUME_KIND, kinds.KILL_RESUME_SCHEMA_VERSION),
    "tokenizer.py": (kinds.BENCH_TOKENIZER_KIND, kinds.BENCH_TOKENIZER_SCHEMA_VERSION),
    "mutants.py": (kinds.MUTANTS_KIND, kinds.MUTANTS_SCHEMA_VERSION),
    "startup.py": (kinds.BENCH_STARTUP_KIND, kinds.BENCH_STARTUP_SCHEMA_VERSION),
    "load.py": (kinds.BENCH_LOAD_KIND, kinds.BENCH_LOAD_SCHEMA_VERSION),
    "lm_eval_parts.py": (kinds.BENCH_LM_EVAL_PARTS_KIND, kinds.BENCH_LM_EVAL_PARTS_SCHEMA_VERSION),
    "export_fp8.py": (kinds.BENCH_EXPORT_FP8_KIND, kinds.BENCH_EXPORT_FP8_SCHEMA_VERSION),
    "export_mlx.py": (kinds.BENCH_EXPORT_MLX_KIND, kinds.BENCH_EXPORT_MLX_SCHEMA_VERSION),
    "gguf_export.py": (kinds.BENCH_EXPORT_GGUF_KIND, kinds.BENCH_EXPORT_GGUF_SCHEMA_VERSION),
}


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_standalone_scripts_write_the_kind_kinds_py_names(script: str) -> None:
    """Read without importing them (vLLM's scripts need vLLM's venv)."""
    constants = module_constants(ROOT / "bench" / script)
    kind_name, version_name = SCRIPTS[script]
    assert (constants[kind_name], constants[version_name]) == SCRIPT_KINDS[script]
    assert constants[version_name] in SCHEMAS[constants[kind_name]].versions


def test_every_benchmark_of_the_suite_writes_a_kind_the_report_reads() -> None:
    """The registry's modules name their kind from kinds.py, at the suite's envelope version."""
    for name in BENCHMARKS:
        module = load_benchmark(name)
        assert module.KIND.startswith("plamo2-bench-"), name
        assert kinds.BENCH_SCHEMA_VERSION in SCHEMAS[module.KIND].versions, name
    assert len({load_benchmark(n).KIND for n in BENCHMARKS}) == len(BENCHMARKS)


def write(path: Path, data: Any) -> Path:
    path.write_text(json.dumps(data))
    return path


def test_recognised_by_kind_never_by_keys(tmp_path: Path) -> None:
    verify = json.loads((Path(__file__).parent / "fixtures" / "verify" / "verify-cpu.json").read_text())
    assert classify(verify) == ("verify", "")
    untagged = {k: v for k, v in verify.items() if k not in ("kind", "schema_version")}
    cases = {
        "untagged.json": (untagged, "not a recognised results file (keys: "),
        "newer.json": (
            {**verify, "schema_version": 2},
            "plamo2-verify schema_version 2: this plamo2-tools reads version 1",
        ),
        "unversioned.json": ({**untagged, "kind": VERIFY_KIND}, "plamo2-verify schema_version None: "),
        "other-kind.json": (
            {**verify, "kind": "plamo2-something"},
            "kind 'plamo2-something' is not one this report reads",
        ),
        "broken-layouts.json": ({**verify, "layouts": {}}, "plamo2-verify version 1 without a valid layouts"),
        "bool-count.json": (
            {"kind": CONVERT_KIND, "schema_version": 1, "tp": True, "pp": 1, "ranks": []},
            "plamo2-convert version 1 without a valid tp",
        ),
        "records.json": (
            [{"kernel": "ssd", "impl": "ours", "median_ms": 1.0}],
            "not a recognised results file (a JSON list)",
        ),
    }
    for name, (data, _) in cases.items():
        write(tmp_path / name, data)
    (tmp_path / "stream.jsonl").write_text('{"kernel": "ssd", "impl": "ours", "median_ms": 1.0}\n{"kernel": "x"}\n')
    docs, skipped = collect([tmp_path])
    assert docs == []
    reasons = {Path(s.name).name: s.reason for s in skipped}
    for name, (_, reason) in cases.items():
        assert reasons[name].startswith(reason), (name, reasons[name])
    assert reasons["stream.jsonl"] == "not a recognised results file (a JSON list)"


def test_kernel_stream_needs_its_header_and_a_known_version(tmp_path: Path) -> None:
    record = {"section": "perf", "kernel": "ssd", "impl": "ours", "median_ms": 1.0}
    header = {"kind": BENCH_KERNELS_KIND, "schema_version": 1}
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps(r) + "\n" for r in (header, record, header, {**record, "median_ms": 2.0})))
    assert classify(load(good)) == ("bench-kernels", "")  # a rerun appended to the stream: two headers
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("".join(json.dumps(r) + "\n" for r in (header, record, {**header, "schema_version": 9})))
    assert classify(load(mixed))[1] == "plamo2-bench-kernels schema_version 1, 9: this plamo2-tools reads version 1, 2"
    verify_stream = tmp_path / "verify.jsonl"
    verify_stream.write_text(json.dumps({"kind": VERIFY_KIND, "schema_version": 1}) + "\n" + json.dumps(record) + "\n")
    assert "only plamo2-bench-kernels streams" in classify(load(verify_stream))[1]


def test_what_the_tools_write_is_read(cli, checkpoint, tmp_path: Path) -> None:
    """convert / check / inspect --json and verify --output from the real commands."""
    src = checkpoint("tiny", seed=3)
    out = tmp_path / "results"
    out.mkdir()
    shards = tmp_path / "tp2pp1"
    (out / "convert.json").write_text(cli("convert", src, shards, "--tp", "2", "--json").stdout)
    (out / "check.json").write_text(cli("check", shards, "--json").stdout)
    (out / "inspect-shards.json").write_text(cli("inspect", shards, "--json").stdout)
    (out / "inspect-hf.json").write_text(cli("inspect", src, "--json").stdout)
    cli("verify", shards, "--reference", src, "--random", "1", "--max-new-tokens", "2", "--output", out / "verify.json")
    result = build_report([out], tmp_path / "r.md", timestamp=False)
    assert result.skipped == []
    assert sorted((Path(d.name).name, d.kind) for d in result.docs) == [
        ("check.json", "check"),
        ("convert.json", "convert"),
        ("inspect-hf.json", "inspect"),
        ("inspect-shards.json", "inspect"),
        ("verify.json", "verify"),
    ]


def test_every_committed_result_is_recognised() -> None:
    """reports/ holds results of every kind; none may fall out of the report (only duplicates go)."""
    docs, skipped = collect([ROOT / "reports"])
    assert [s for s in skipped if not s.reason.startswith(("same results as", "all its measurements"))] == []
    assert {d.kind for d in docs} >= {"verify", "bench-convert", "bench-kernels", "bench-throughput", "bench-serving"}
