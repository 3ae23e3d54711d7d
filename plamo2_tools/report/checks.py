"""Results of the compatibility and robustness scripts: vLLM 0.26's own loaders on our shards
(bench/vllm_compat.py), the native tokenizer against PLaMo's original (bench/tokenizer.py), and
convert killed at random points then resumed (bench/kill_resume.py), the fuzz campaign of hostile
inputs (bench/fuzz.py), and the planted bugs the tests must catch (bench/mutants.py)."""

from __future__ import annotations

from typing import Any

from .context import Context
from .inputs import BENCH_FUZZ, BENCH_TOKENIZER, KILL_RESUME, MUTANTS, VLLM_COMPAT, VLLM_FORWARD, Doc
from .markdown import MISSING, code, num, table


def render(docs: list[Doc], ctx: Context) -> list[str]:
    lines = ["## Compatibility and robustness", ""]
    for kind, title, make in (
        (VLLM_COMPAT, "vLLM's own loaders on our shards (and FP8 exports)", vllm_table),
        (VLLM_FORWARD, "vLLM 0.26's own PLaMo 3 forward vs our oracle", forward_table),
        (BENCH_TOKENIZER, "Native tokenizer vs PLaMo's original", tokenizer_table),
        (KILL_RESUME, "convert killed and resumed", kill_table),
        (BENCH_FUZZ, "Fuzzed inputs: exit 0-3 with one line, never 70, never a hang", fuzz_table),
        (MUTANTS, "Planted bugs the tests catch", mutants_table),
    ):
        chosen = [d for d in docs if d.kind == kind]
        if chosen:
            lines += [f"### {title}", "", *make(chosen), ""]
    return lines


def vllm_table(docs: list[Doc]) -> list[str]:
    rows = []
    for doc in docs:
        d = doc.data
        s: dict[str, Any] = d["summary"]
        opts = d.get("options") or {}
        rows.append(
            [
                code(doc.name),
                num(d.get("vllm_version")),
                "FP8 export" if opts.get("fp8") else "shards",
                num(opts.get("dtype")),
                num(opts.get("presets")),
                num(opts.get("tp")),
                str(s.get("pass", 0) + s.get("pass-vllm-hf-bug", 0)),
                str(s.get("pass-vllm-hf-bug", 0)),
                str(s.get("pass-cuda-rounding", 0)),
                str(s.get("pass-exp-rounding", 0)),
                str(s.get("fail", 0)),
                str(s.get("skipped", 0)),
            ]
        )
    headers = [
        "File",
        "vLLM",
        "checked",
        "dtype",
        "presets",
        "TP",
        "bit-identical",
        "of which vLLM's HF loader fails",
        "equal to vLLM on CUDA (CPU rounds norm offsets twice)",
        "A within 1 ulp (exp: ours correctly rounded, torch's not)",
        "fail",
        "not valid splits",
    ]
    return table(headers, rows, right=(6, 7, 8, 9, 10, 11))


def forward_table(docs: list[Doc]) -> list[str]:
    rows = []
    for doc in docs:
        for c in doc.data["cases"]:
            lg = c.get("logits") or {}
            rows.append(
                [
                    code(doc.name),
                    num(c.get("case")),
                    num(c.get("window")),
                    num(c.get("prompt_len")),
                    num(lg.get("max_abs_diff_vs_oracle_vllm")),
                    num(lg.get("max_rel_diff_vs_oracle_vllm")),
                    "yes" if lg.get("argmax_equal_vs_oracle_vllm") else "no",
                    num((c.get("rope") or {}).get("max_abs_diff")),
                    num(c.get("status")),
                ]
            )
    headers = ["File", "case", "W", "prompt", "max abs Δlogit", "max rel", "argmax equal", "RoPE table Δ", "status"]
    return table(headers, rows, right=(2, 3, 4, 5, 7))


def tokenizer_table(docs: list[Doc]) -> list[str]:
    rows = []
    for doc in docs:
        for name, s in doc.data["summary"].items():
            if not isinstance(s, dict) or "ns_per_char" not in s:
                continue
            ns = s["ns_per_char"]
            rows.append(
                [
                    code(doc.name),
                    name,
                    num(ns.get("original_call")),
                    num(ns.get("native_call_warm")),
                    num(s.get("call_speedup_warm")),
                    num(ns.get("original_encoder")),
                    num(ns.get("native_encoder_warm")),
                    num(s.get("encoder_speedup_warm")),
                    "yes" if s.get("identical_ids") else "NO",
                ]
            )
    headers = [
        "File",
        "texts",
        "original call ns/char",
        "native call ns/char",
        "call speed-up",
        "original encoder ns/char",
        "native encoder ns/char",
        "encoder speed-up",
        "same ids",
    ]
    return table(headers, rows, right=(2, 3, 4, 5, 6, 7))


def kill_table(docs: list[Doc]) -> list[str]:
    rows = []
    for doc in docs:
        d = doc.data
        rows.append(
            [
                code(doc.name),
                num(d.get("preset")),
                f"TP{num(d.get('tp'))}×PP{num(d.get('pp'))}",
                str(len(d["trials"])),
                num(d.get("interrupted_mid_way", MISSING)),
                "yes" if d["all_identical"] else "NO",
            ]
        )
    return table(
        ["File", "preset", "layout", "kills", "killed mid-way", "every resume byte-identical"], rows, right=(3, 4)
    )


def fuzz_table(docs: list[Doc]) -> list[str]:
    rows = []
    for doc in docs:
        for target, t in sorted(doc.data["targets"].items()):
            outcomes = ", ".join(f"{k}: {v}" for k, v in sorted(t["outcomes"].items()))
            rows.append([code(doc.name), target, str(t["tried"]), outcomes, str(t.get("contract_broken", 0))])
    return table(["File", "target", "inputs", "outcomes", "contract broken"], rows, right=(2, 4))


def mutants_table(docs: list[Doc]) -> list[str]:
    """Per class of planted bug: caught of planted, and the survivors by name (docs/testing.md
    says why each may survive)."""
    rows = []
    for doc in docs:
        by: dict[str, list[dict[str, Any]]] = {}
        for m in doc.data["mutants"]:
            by.setdefault(str(m.get("cls")), []).append(m)
        for cls, ms in sorted(by.items()):
            survived = [str(m.get("name")) for m in ms if m.get("verdict") != "caught"]
            caught = len(ms) - len(survived)
            rows.append([code(doc.name), cls, f"{caught} / {len(ms)}", ", ".join(survived) or "—"])
        d = doc.data
        rows.append([code(doc.name), "**all**", f"**{d['caught']} / {d['total']}**", ""])
    return table(["File", "class", "caught", "survived"], rows, right=(2,))
