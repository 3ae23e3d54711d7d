"""The fuzz campaign of issues 21 and 28 (docs/security.md, "Fuzzing"): Hypothesis generates and
mutates the files plamo2-tools reads (safetensors headers, manifests, PLaMo 2 and PLaMo 3 configs,
tokenizer.jsonl files and rows, journals, result files for `report`, batch request files and the
results files they resume from) and its option values, runs the real command on each, and
holds every run to the contract: exit 0, 1, 2 or 3; on 2 or 3 exactly one `error:` line; never
exit 70, never a traceback, never longer than `LIMIT_S` (a hang).

`tests/security/test_fuzz.py` runs a short campaign in the suite, `bench/fuzz.py` a long one that
records how many inputs each target tried and how they ended (reports/fuzz/).  Commands run
in-process (Click's runner over the real `app`): a subprocess per input would cost a second of
imports each, i.e. 50 times fewer inputs for the same time.
"""

from __future__ import annotations

import copy
import json
import shutil
import signal
import struct
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import strategies as st
from typer.testing import CliRunner

LIMIT_S = 30  # one input: far above the slowest honest run here (a tiny convert, ~0.3 s)
DEEP = "__PLAMO2_FUZZ_DEEP__"  # replaced by nesting of a drawn depth when the text is written
HOSTILE_NAMES = [
    "../outside/secret.txt",
    "/etc/hostname",
    "a/b",
    "",
    ".",
    "..",
    "x\x00y",
    "x" * 300,
    "plamo2_shards.json",
    ".plamo2.lock",
    "config.json",
]
OPTION_VALUES = [
    "inf",
    "-inf",
    "nan",
    "1e400",
    "-1",
    "0",
    "1",
    "2",
    "3",
    "7",
    "0x10",
    "",
    " ",
    "5GiB",
    "1e30",
    "9" * 40,
    "auto",
    "bfloat16",
    "1,1",
    "2,2",
    "-3,7",
    "1.5",
    "true",
    "Ⅻ",
    "1e-300",
]

# Numbers at the edges a config or a request meets: zero, negative, past int32/int64, huge floats.
EDGE_NUMBERS = [0, -1, -64, 1, 2, 0.5, 1.0, 32.0, 2**31, 2**63, 10**9, 1e300, 1e308, -1e308, 5e-324]
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats()
    | st.text(max_size=12)
    | st.sampled_from(HOSTILE_NAMES)
    | st.just(DEEP)
)
json_values = st.recursive(
    scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=12
)


def paths(value: Any, limit: int = 4000) -> list[tuple[Any, ...]]:
    """Every path into a JSON tree (keys and indices), breadth first, at most `limit`."""
    out: list[tuple[Any, ...]] = [()]
    i = 0
    while i < len(out) and len(out) < limit:
        node = _at(value, out[i])
        if isinstance(node, dict):
            out += [(*out[i], k) for k in node]
        elif isinstance(node, list):
            out += [(*out[i], j) for j in range(len(node))]
        i += 1
    return out[:limit]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _at(value: Any, path: tuple[Any, ...]) -> Any:
    for k in path:
        value = value[k]
    return value


@st.composite
def mutated_json(draw: st.DrawFn, base: Any) -> str:
    """`base` with one to three subtrees replaced, deleted, renamed to hostile names or nested
    deeply, then written as text, sometimes cut short or with a flipped byte."""
    value = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(paths(value)))
        op = draw(st.sampled_from(["replace", "replace", "delete", "rename", "deep", "edge"]))
        if not path:
            value = draw(json_values) if op != "deep" else DEEP
            continue
        parent, key = _at(value, path[:-1]), path[-1]
        if op == "delete":
            del parent[key]
        elif op == "rename" and isinstance(parent, dict):
            parent[draw(st.sampled_from(HOSTILE_NAMES))] = parent.pop(key)
        elif op == "deep":
            parent[key] = DEEP
        elif op == "edge":  # a number at an edge where a number was (a value the code divides by...)
            parent[key] = draw(st.sampled_from(EDGE_NUMBERS)) if _is_number(parent[key]) else draw(json_values)
        else:
            parent[key] = draw(json_values)
    text = json.dumps(value, allow_nan=True)
    depth = draw(st.sampled_from([2, 63, 65, 1000, 100_000]))
    text = text.replace(f'"{DEEP}"', "[" * depth + "]" * depth)
    cut = draw(st.sampled_from(["none", "none", "none", "truncate", "flip"]))
    if cut == "truncate" and text:
        text = text[: draw(st.integers(0, len(text) - 1))]
    elif cut == "flip" and text:
        at = draw(st.integers(0, len(text) - 1))
        text = text[:at] + chr((ord(text[at]) ^ 0x20) or 1) + text[at + 1 :]
    return text


@st.composite
def nudged_json(draw: st.DrawFn, base: Any) -> str:
    """`base` with one or two of its numbers moved (to an edge, halved, doubled, one off): mostly a
    config that still parses and types, so the checks past parsing (and the runs) get exercised."""
    value = copy.deepcopy(base)
    numbers = [p for p in paths(value) if p and _is_number(_at(value, p))]
    for _ in range(draw(st.integers(1, 2)) if numbers else 0):
        path = draw(st.sampled_from(numbers))
        parent, old = _at(value, path[:-1]), _at(value, path)
        # a sibling's value too: two numbers a rule orders made equal (YaRN's beta_fast = beta_slow)
        siblings = [v for v in (parent.values() if isinstance(parent, dict) else parent) if _is_number(v)]
        new = draw(
            st.sampled_from([0, -1, -64, 1, 10**9, 1e300, old * 2, old / 2, old + 1, old - 1, -old])
            | st.sampled_from(siblings)
        )
        parent[path[-1]] = int(new) if isinstance(old, int) and float(new).is_integer() else new
    return json.dumps(value, allow_nan=True)


# ---- the contract -----------------------------------------------------------------------------------
class Hang(Exception):
    pass


@contextmanager
def time_limit(seconds: int) -> Iterator[None]:
    def expire(signum: int, frame: object) -> None:
        raise Hang(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


_RUNNER = CliRunner(env={"COLUMNS": "250", "NO_COLOR": "1"})


def run_cli(args: list[str | Path], input: str | None = None) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of one in-process run of the real CLI, bounded in time."""
    from plamo2_tools.cli import app

    with time_limit(LIMIT_S):
        r = _RUNNER.invoke(app, [str(a) for a in args], input=input)
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise AssertionError(f"uncaught {type(r.exception).__name__}: {r.exception}")
    return r.exit_code, r.stdout, r.stderr


def verdict(code: int, stdout: str, stderr: str, warnings: bool = False) -> str | None:
    """None when a run kept the contract, else what it broke.  `warnings`: `warning:` lines may come
    before the error line (a batch file reports each refused line, then fails naming them)."""
    if code not in (0, 1, 2, 3):
        return f"exit {code}"
    if "Traceback" in stderr + stdout:
        return "a traceback"
    if code in (2, 3):
        lines = [line for line in stderr.splitlines() if not (warnings and line.startswith("warning:"))]
        errors = [line for line in lines if line.startswith("error:")]
        others = [line for line in lines if line.strip() and not line.startswith("error:")]
        if len(errors) != 1 or others:
            return f"{len(errors)} error line(s) and {len(others)} other line(s) on stderr"
    return None


@dataclass
class Tally:
    """What a campaign saw: inputs per target, outcomes, and the first inputs that broke it."""

    tried: Counter = field(default_factory=Counter)
    outcomes: dict[str, Counter] = field(default_factory=dict)
    failures: list[dict[str, str]] = field(default_factory=list)

    def record(self, target: str, outcome: str, failure: str | None = None, example: str = "") -> None:
        self.tried[target] += 1
        self.outcomes.setdefault(target, Counter())[outcome] += 1
        if failure is not None and len(self.failures) < 50:
            self.failures.append({"target": target, "failure": failure, "input": example[:2000]})


# ---- the targets -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Bases:
    """The valid inputs the mutations start from."""

    ckpt: Path  # tiny, with its tokenizer
    shards: Path  # tiny at tp 2
    results: dict[str, Any]  # check / convert / inspect results
    plamo3: tuple[Path, ...] = ()  # tiny3 (transformers v4 config form), tiny3-yarn (v5 form, YaRN)


def make_bases(root: Path) -> Bases:
    from plamo2_tools.model.synth import synth

    ckpt = root / "ckpt"
    synth(ckpt, "tiny", seed=0)
    plamo3 = tuple(root / name for name in ("tiny3", "tiny3-yarn"))
    for path in plamo3:
        synth(path, path.name, seed=0)
    shards = root / "shards"
    results = {}
    for name, args in (
        ("convert", ["convert", ckpt, shards, "--tp", 2, "--json"]),
        ("check", ["check", shards, "--json"]),
        ("inspect", ["inspect", ckpt, "--json"]),
    ):
        code, out, err = run_cli(args)
        assert code == 0, err
        results[name] = json.loads(out)
    return Bases(ckpt, shards, results, plamo3)


# (args, or a chain of args lists run while each exits 0; stdin; the input, for the record)
Target = Callable[[st.DrawFn, Bases, Path], tuple[list[Any], str | None, str]]


def _scratch_copy(src: Path, scratch: Path, name: str) -> Path:
    dst = scratch / name
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".plamo2.lock"))
    return dst


def header_target(draw: st.DrawFn, b: Bases, scratch: Path) -> tuple[list[str | Path], str | None, str]:
    ckpt = _scratch_copy(b.ckpt, scratch, "ckpt")
    weights = ckpt / "model.safetensors"
    data = weights.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    if draw(st.booleans()):  # the whole header: offsets and shapes too (mostly refused)
        text = draw(mutated_json(header))
    else:  # only __metadata__: the tensors stay valid, so the readers get past the offsets
        hole = '"__PLAMO2_FUZZ_METADATA__"'
        text = json.dumps({**header, "__metadata__": "__PLAMO2_FUZZ_METADATA__"}).replace(
            hole, draw(mutated_json(header["__metadata__"]))
        )
    raw = text.encode("utf-8", "surrogatepass")
    length = draw(st.sampled_from([len(raw), len(raw), 0, 7, 2**63, len(raw) + 5]))
    weights.write_bytes(struct.pack("<Q", length) + raw + data[8 + n :])
    args: list[str | Path] = draw(st.sampled_from([["inspect", ckpt], ["convert", ckpt, scratch / "out"]]))
    return args, None, text


def manifest_target(draw: st.DrawFn, b: Bases, scratch: Path) -> tuple[list[str | Path], str | None, str]:
    shards = _scratch_copy(b.shards, scratch, "shards")
    text = draw(mutated_json(json.loads((shards / "plamo2_shards.json").read_text())))
    (shards / "plamo2_shards.json").write_text(text, errors="surrogatepass")
    args = draw(
        st.sampled_from(
            [
                ["check", shards],
                ["check", shards],
                ["merge", shards, scratch / "merged"],
                ["convert", shards, scratch / "tp1", "--tp", "1"],
                ["inspect", shards],
            ]
        )
    )
    return args, None, text


def config_target(draw: st.DrawFn, b: Bases, scratch: Path) -> tuple[list[str | Path], str | None, str]:
    ckpt = _scratch_copy(b.ckpt, scratch, "ckpt")
    text = draw(mutated_json(json.loads((ckpt / "config.json").read_text())))
    (ckpt / "config.json").write_text(text, errors="surrogatepass")
    args = draw(st.sampled_from([["inspect", ckpt], ["convert", ckpt, scratch / "out", "--tp", "2"]]))
    return args, None, text


def tokenizer_target(draw: st.DrawFn, b: Bases, scratch: Path) -> tuple[list[str | Path], str | None, str]:
    ckpt = _scratch_copy(b.ckpt, scratch, "ckpt")
    rows = [json.loads(line) for line in (ckpt / "tokenizer.jsonl").read_text().splitlines()]
    text = draw(mutated_json(rows))
    try:
        value = json.loads(text)
        lines = "\n".join(json.dumps(r) for r in value) if isinstance(value, list) else text
    except (ValueError, RecursionError):
        lines = text
    (ckpt / "tokenizer.jsonl").write_text(lines + "\n", errors="surrogatepass")
    prompt = json.dumps(draw(st.text(max_size=20)))
    return ["tokenize", ckpt], prompt + "\n", lines[:2000]


def journal_target(draw: st.DrawFn, b: Bases, scratch: Path) -> tuple[list[str | Path], str | None, str]:
    out = scratch / "out"
    out.mkdir()
    head = {"fingerprint": draw(st.text(max_size=8)), "writes": ["model-rank-0-part-0.safetensors", "config.json"]}
    record = {"file": "model-rank-0-part-0.safetensors", "size": 1, "digest": "00", "tensors": {}}
    lines = [draw(mutated_json(head)), draw(mutated_json(record))]
    (out / ".plamo2_convert.journal.jsonl").write_text("\n".join(lines) + "\n", errors="surrogatepass")
    (out / "config.json").write_text("{}")
    args: list[str | Path] = ["convert", b.ckpt, out] + (["--force"] if draw(st.booleans()) else [])
    return args, None, "\n".join(lines)


def result_target(draw: st.DrawFn, b: Bases, scratch: Path) -> tuple[list[str | Path], str | None, str]:
    kind = draw(st.sampled_from(sorted(b.results)))
    text = draw(mutated_json(b.results[kind]))
    (scratch / "runs").mkdir()
    (scratch / "runs" / f"{kind}.json").write_text(text, errors="surrogatepass")
    return ["report", scratch / "runs", "--out", scratch / "report.md"], None, text


def options_target(draw: st.DrawFn, b: Bases, scratch: Path) -> tuple[list[str | Path], str | None, str]:
    value = draw(st.sampled_from(OPTION_VALUES) | st.text(max_size=10))
    choice = draw(st.sampled_from(["convert", "merge", "generate", "tokenize"]))
    if choice == "convert":
        option = draw(
            st.sampled_from(["--max-part-size", "--tp", "--pp", "--pp-layers", "--dtype", "--workers", "--copy"])
        )
        args: list[str | Path] = ["convert", b.ckpt, scratch / "out", option, value]
    elif choice == "merge":
        args = ["merge", b.shards, scratch / "merged", "--max-part-size", value]
    elif choice == "generate":
        option = draw(st.sampled_from(["--temperature", "--top-p", "--seed", "--max-new-tokens"]))
        if option == "--max-new-tokens" and value.strip().isdigit() and int(value) > 4:
            value = "4"  # a huge honest request is slow, not a bug
        args = ["generate", b.shards, "--prompt", "hello", "--max-new-tokens", "2", option, value]
    else:
        args = ["tokenize", b.ckpt, draw(st.sampled_from(["--decode", "--skip-special-tokens"]))]
        return args, draw(st.sampled_from(["[1, 2]\n", "[-1]\n", f"[{2**70}]\n", '"x"\n', "[[1]]\n"])), value
    return args, None, " ".join(map(str, args[3:]))


def plamo3_config_target(draw: st.DrawFn, b: Bases, scratch: Path) -> tuple[list[Any], str | None, str]:
    """A PLaMo 3 config (either form, YaRN or not), mutated; inspected, converted, or converted and
    then checked and run: a config convert and check accept must not crash the run (issue 28)."""
    ckpt = _scratch_copy(draw(st.sampled_from(b.plamo3)), scratch, "ckpt")
    base = json.loads((ckpt / "config.json").read_text())
    text = draw(nudged_json(base) | mutated_json(base))
    (ckpt / "config.json").write_text(text, errors="surrogatepass")
    out = scratch / "out"
    chain = [["convert", ckpt, out], ["check", out], ["generate", out, "--prompt", "hi", "--max-new-tokens", "2"]]
    args = draw(st.sampled_from([[["inspect", ckpt]], [["convert", ckpt, out, "--tp", "2"]], chain]))
    return args, None, text


PIECES = [
    "\ud800",
    "a\udfffb",
    "x" * 1025,
    "y" * 5000,
    "",
    "<0x41>",
    "<0xZZ>",
    "<|plamo:bos|>",
    "\uee00",
    " " * 64,
    "\x00",
]
SCORES = [1e308, -1e308, 2e5, 214748.3647, -214748.3648, 5e-324, -1000.0, -2000.0, float("nan"), float("inf"), 0, "1"]


def tokenizer_pieces_target(draw: st.DrawFn, b: Bases, scratch: Path) -> tuple[list[Any], str | None, str]:
    """tokenizer.jsonl with one to four rows replaced by hostile ones (long pieces, surrogates, scores
    past PLaMo's int32 table, wrong types) or added; tokenized, decoded, or converted (issue 28)."""
    ckpt = _scratch_copy(b.ckpt, scratch, "ckpt")
    rows = [json.loads(line) for line in (ckpt / "tokenizer.jsonl").read_text().splitlines()]
    piece = st.sampled_from(PIECES) | st.text(max_size=8)
    score = st.sampled_from(SCORES) | st.floats()
    kind = st.sampled_from(["NORMAL", "BYTE", "CONTROL", "UNKNOWN", 5, None])
    row = st.tuples(piece, score, kind).map(list) | st.tuples(piece, score).map(list)
    for _ in range(draw(st.integers(1, 4))):
        if draw(st.booleans()):
            rows[draw(st.integers(0, len(rows) - 1))] = draw(row)
        else:
            rows.append(draw(row))
    lines = "".join(json.dumps(r, allow_nan=True) + "\n" for r in rows)
    (ckpt / "tokenizer.jsonl").write_text(lines)
    ids = json.dumps(draw(st.lists(st.integers(0, len(rows) + 2), min_size=1, max_size=6)))
    args, stdin = draw(
        st.sampled_from(
            [
                (["tokenize", ckpt], json.dumps(draw(st.text(max_size=20))) + "\n"),
                (["tokenize", ckpt, "--decode"], ids + "\n"),
                (["convert", ckpt, scratch / "out"], None),
            ]
        )
    )
    return args, stdin, json.dumps(rows[-4:])[:2000]


REQUEST = {
    "prompt": "hello",
    "max_tokens": 2,
    "temperature": 0.5,
    "top_p": 0.9,
    "seed": 1,
    "stop": ["x"],
    "n": 2,
    "logprobs": 1,
    "echo": False,
    "ignore_eos": True,
}
RECORD = {
    "index": 0,
    "input_sha256": "0" * 64,
    "choices": [
        {"index": 0, "text": "a", "logprobs": None, "finish_reason": "length", "stop_reason": None, "token_ids": [1, 2]}
    ],
    "usage": {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4},
}


def batch_target(draw: st.DrawFn, b: Bases, scratch: Path) -> tuple[list[Any], str | None, str]:
    """A batch request file (mutated requests, plain text, broken JSON) run into an --output that is
    absent, empty, someone else's, or ours with mutated records to resume from (issue 28)."""
    from plamo2_tools.serve.batch import run_header
    from plamo2_tools.shards.manifest import load_manifest

    line = st.one_of(
        mutated_json(REQUEST),
        st.text(max_size=30).filter(lambda t: "\n" not in t and "\r" not in t),
        st.just(json.dumps(REQUEST)),
    )
    lines = draw(st.lists(line, min_size=1, max_size=4))
    src = scratch / "in.jsonl"
    src.write_text("\n".join(x.replace("\n", " ") for x in lines) + "\n", errors="surrogatepass")
    out = scratch / "out.jsonl"
    defaults = {"max_tokens": 2, "temperature": 0.0, "top_p": 1.0, "seed": 0}
    header = json.dumps(run_header(load_manifest(b.shards), defaults, {}), sort_keys=True)
    state = draw(st.sampled_from(["absent", "empty", "foreign", "ours", "ours", "header-mutated"]))
    if state == "empty":
        out.touch()
    elif state == "foreign":
        out.write_text("notes\n")
    elif state == "ours":
        records = [draw(mutated_json(dict(RECORD, index=i))) for i in range(draw(st.integers(0, 3)))]
        out.write_text(header + "\n" + "".join(r.replace("\n", " ") + "\n" for r in records), errors="surrogatepass")
    elif state == "header-mutated":
        out.write_text(
            draw(mutated_json(json.loads(header))).replace("\n", " ") + "\n" + json.dumps(RECORD) + "\n",
            errors="surrogatepass",
        )
    args: list[Any] = [
        "generate",
        b.shards,
        "--input",
        src,
        "--output",
        out,
        "--max-new-tokens",
        "2",
        "--json",
        "--max-context",
        draw(st.sampled_from(["16", "64", "2"])),
        "--max-batch",
        "4",
    ]
    if draw(st.booleans()):
        args.append("--strict")
    return args, None, "\n".join(lines)[:2000]


TARGETS: dict[str, Target] = {
    "safetensors-header": header_target,
    "manifest": manifest_target,
    "config": config_target,
    "tokenizer-rows": tokenizer_target,
    "journal": journal_target,
    "result-file": result_target,
    "cli-options": options_target,
    "plamo3-config": plamo3_config_target,
    "tokenizer-pieces": tokenizer_pieces_target,
    "batch-file": batch_target,
}
WARNINGS_OK = {"batch-file"}  # targets whose command reports refused lines as `warning:` before failing


def run_target(name: str, draw: st.DrawFn, bases: Bases, scratch: Path, tally: Tally | None = None) -> str | None:
    """Make one input for target `name`, run it, check the contract.  Returns what broke (None:
    kept); with a tally, records the outcome instead of leaving it to the caller only."""
    made, stdin, example = TARGETS[name](draw, bases, scratch)
    chain = made if made and isinstance(made[0], list) else [made]  # a chain: each step runs if the last passed
    broke, outcome = None, "exit 0"
    for args in chain:
        try:
            code, out, err = run_cli(args, stdin)
            broke = verdict(code, out, err, warnings=name in WARNINGS_OK)
            outcome = f"exit {code}"
            if broke:
                broke = f"{broke}: {' '.join(map(str, args))}\n{err[-1500:]}"
        except Hang as e:
            broke, outcome = f"hang ({e}): {' '.join(map(str, args))}", "hang"
        except AssertionError as e:
            broke, outcome = f"{e}: {' '.join(map(str, args))}", "crash"
        if broke or outcome != "exit 0":
            break
    if tally is not None:
        tally.record(name, outcome, broke, example)
    return broke
