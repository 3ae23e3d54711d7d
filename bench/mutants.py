"""Mutation testing as a habit (issue 24): plant named bugs one at a time, run the tests that should
catch each, report caught / survived.

Each mutant is the kind of bug a tired engineer writes (an off-by-one, a swapped condition, a
dropped update, a wrong exit code) in a module where it would hurt users: the convert writer, the
shard integrity checks and lock, the scheduler and sampling, the stop rules, the tokenizer's
encoder and the error mapping.  A mutant names its file, an exact snippet of today's code (found
exactly once: `tests/test_mutant_registry.py` fails when the code moves on and a snippet rots),
its replacement, its class (the blind spots of issue 24) and the few test files that should catch
it, so that a run takes minutes, not hours.

The mutants are planted in a private copy of the repository (never in the working tree), one at a
time, and the copy's file is restored after each.  A mutant is *caught* when its tests fail (or
time out: a hang is a failure a user would see too), *survived* when they pass.

    python bench/mutants.py                      # every mutant -> reports/mutants/mutants.json + .md
    python bench/mutants.py --only writer-user-window-offset --keep-going
    python bench/mutants.py --list

Survivors are explained in docs/testing.md (equivalent, or accepted with a reason).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KIND, SCHEMA_VERSION = "plamo2-mutants", 1


@dataclass(frozen=True)
class Mutant:
    name: str
    cls: str  # the blind-spot class of issue 24 (or the module's own class)
    file: str  # relative to the repository root
    original: str  # exact snippet of today's code, found exactly once in `file`
    replacement: str
    tests: tuple[str, ...]  # pytest arguments: files, node ids; "-k EXPR" allowed as one item
    why: str = ""  # what a user would suffer


W = "plamo2_tools/convert/writer.py"
SRC_CHECK = ("tests/convert/test_source_check.py",)
CONVERT = ("tests/convert/test_source_check.py", "tests/convert/test_convert.py")
INTEGRITY = "plamo2_tools/shards/integrity.py"
LOCK = "plamo2_tools/output_lock.py"
SCHED = "plamo2_tools/runtime/batching/scheduler.py"
SAMPLING = "plamo2_tools/runtime/batching/sampling.py"
GEN = "plamo2_tools/runtime/batching/generation.py"
GRAPHS = "plamo2_tools/runtime/batching/graphs.py"
TEXT = "plamo2_tools/runtime/batching/text.py"
STOPS = "plamo2_tools/eval/stop_rules.py"
ENC = "plamo2_tools/tokenizer/encoder.py"
ERR = "plamo2_tools/errors.py"
CLI_ERR = "plamo2_tools/cli/errors.py"
SIO = "plamo2_tools/safetensors_io.py"
OUTPUTS = "plamo2_tools/outputs.py"
ENGINE = "plamo2_tools/convert/engine.py"

T_SAMPLING = ("tests/runtime/test_sampling_oracle.py",)
T_STOPS = ("tests/runtime/test_stop_boundaries.py",)
T_LOCK = ("tests/shards/test_lock_cases.py", "tests/shards/test_output_lock.py")
T_ERRORS = ("tests/cli/test_error_mapping.py",)
T_MULTIPART = ("tests/runtime/test_multipart_ranks.py",)
T_PAIR = ("tests/tokenizer/test_pair_inputs.py",)
T_DURABLE = ("tests/convert/test_durability.py",)

MUTANTS: list[Mutant] = []  # filled below, grouped by class


def mutant(*args: object, **kwargs: object) -> None:
    MUTANTS.append(Mutant(*args, **kwargs))  # type: ignore[arg-type]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", help="names (or prefixes) of mutants to run")
    ap.add_argument("--list", action="store_true", help="list the registry and exit")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per mutant's test run")
    ap.add_argument("--out", type=Path, default=ROOT / "reports" / "mutants")
    ap.add_argument("--baseline", action="store_true", help="first run every selected test file unmutated")
    args = ap.parse_args()
    chosen = [m for m in MUTANTS if not args.only or any(m.name.startswith(p) for p in args.only)]
    if args.list:
        for m in chosen:
            print(f"{m.name:44} {m.cls:14} {m.file}")
        return
    problems = registry_problems(ROOT, chosen)
    if problems:
        sys.exit("registry rot:\n  " + "\n  ".join(problems))
    with tempfile.TemporaryDirectory(prefix="plamo2-mutants-") as tmp:
        copy = Path(tmp) / "repo"
        _copy_repo(ROOT, copy)
        if args.baseline:
            files = sorted({t for m in chosen for t in m.tests if not t.startswith("-")})
            ok, seconds, tail = _run_tests(copy, tuple(files), args.timeout * 4)
            print(f"baseline: {'pass' if ok else 'FAIL'} in {seconds:.0f} s")
            if not ok:
                sys.exit("the unmutated tests fail:\n" + tail)
        results = [_run_one(copy, m, args.timeout) for m in chosen]
    _write_report(args.out, results, partial=bool(args.only))


def registry_problems(root: Path, mutants: list[Mutant] | None = None) -> list[str]:
    """Snippets not found exactly once, duplicate names, test files that do not exist."""
    problems, names = [], set()
    for m in MUTANTS if mutants is None else mutants:
        if m.name in names:
            problems.append(f"{m.name}: duplicate name")
        names.add(m.name)
        if m.original == m.replacement:
            problems.append(f"{m.name}: replacement equals the original")
        text = (root / m.file).read_text()
        count = text.count(m.original)
        if count != 1:
            problems.append(f"{m.name}: snippet found {count} times in {m.file}")
        for t in m.tests:
            path = t.split("::")[0]
            if not t.startswith("-") and not (root / path).exists():
                problems.append(f"{m.name}: test {path} does not exist")
    return problems


def _copy_repo(src: Path, dst: Path) -> None:
    """What the tests need: the package, the tests, the project file (its pytest settings)."""
    dst.mkdir(parents=True)
    for name in ("plamo2_tools", "tests", "bench"):
        shutil.copytree(src / name, dst / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy2(src / "pyproject.toml", dst / "pyproject.toml")


def _run_tests(copy: Path, tests: tuple[str, ...], timeout: int) -> tuple[bool, float, str]:
    args: list[str] = []
    for t in tests:
        args += t.split(" ", 1) if t.startswith("-") else [t]
    env = {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *args]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, time.perf_counter() - start, "timeout"
    tail = (proc.stdout + proc.stderr)[-2000:]
    if proc.returncode not in (0, 1):  # 2: collection error, 5: nothing collected: not a verdict
        return False, time.perf_counter() - start, f"pytest exit {proc.returncode}: {tail}"
    return proc.returncode == 0, time.perf_counter() - start, tail


def _run_one(copy: Path, m: Mutant, timeout: int) -> dict[str, object]:
    path = copy / m.file
    original = path.read_text()
    path.write_text(original.replace(m.original, m.replacement, 1))
    try:
        passed, seconds, tail = _run_tests(copy, m.tests, timeout)
    finally:
        path.write_text(original)
    if passed:
        verdict = "survived"
    elif tail == "timeout":
        verdict = "caught (timeout)"
    elif tail.startswith("pytest exit"):
        verdict = "error"
    else:
        verdict = "caught"
    print(f"{verdict:17} {seconds:6.1f} s  {m.name}", flush=True)
    failed = [line for line in tail.splitlines() if line.startswith(("FAILED", "ERROR"))]
    return {**asdict(m), "verdict": verdict, "seconds": round(seconds, 1), "failed": failed[:5]}


def _write_report(out: Path, results: list[dict[str, object]], partial: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    caught = [r for r in results if str(r["verdict"]).startswith("caught")]
    data = {
        "kind": KIND,
        "schema_version": SCHEMA_VERSION,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python", "bench/mutants.py", *sys.argv[1:]]),
        "total": len(results),
        "caught": len(caught),
        "score": round(len(caught) / len(results), 4) if results else None,
        "mutants": results,
    }
    stem = "mutants-partial" if partial else "mutants"
    (out / f"{stem}.json").write_text(json.dumps(data, indent=1) + "\n")
    lines = [
        f"# Mutation report ({data['date']})",
        "",
        f"`{data['command']}`: **{len(caught)} of {len(results)} caught** ({100 * (data['score'] or 0):.1f} %).",
        "",
        "| mutant | class | file | verdict | seconds |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {r['name']} | {r['cls']} | `{r['file']}` | {r['verdict']} | {r['seconds']} |" for r in results]
    survivors = [r for r in results if not str(r["verdict"]).startswith("caught")]
    if survivors:
        lines += ["", "Survivors and errors are explained in docs/testing.md."]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print(f"{len(caught)}/{len(results)} caught -> {out / (stem + '.json')}")


# ==== the registry =================================================================================
# ---- copy paths: multi-window tensors and short kernel copies (check --source is the oracle) -------
mutant(
    "writer-user-window-offset",
    "copy-window",
    W,
    "pread_into(src, view, src_off, seg.path)",
    "pread_into(src, view, seg.offset, seg.path)",
    SRC_CHECK,
    "user-space copy re-reads the first window for every larger tensor",
)
mutant(
    "writer-cfr-short-resume",
    "copy-window",
    W,
    "got = os.copy_file_range(src, part.fd, n - done, src_off + done, dst_off + done)",
    "got = os.copy_file_range(src, part.fd, n - done, src_off, dst_off + done)",
    SRC_CHECK,
    "a short copy_file_range resumes at the window's start",
)
mutant(
    "writer-cfr-short-dst",
    "copy-window",
    W,
    "got = os.copy_file_range(src, part.fd, n - done, src_off + done, dst_off + done)",
    "got = os.copy_file_range(src, part.fd, n - done, src_off + done, dst_off)",
    SRC_CHECK,
    "a short copy_file_range writes its rest over its start",
)
mutant(
    "writer-sendfile-short-resume",
    "copy-window",
    W,
    "got = os.sendfile(fd, src, src_off + done, n - done)",
    "got = os.sendfile(fd, src, src_off, n - done)",
    SRC_CHECK,
    "a short sendfile resumes at the window's start",
)
mutant(
    "writer-window-dst-offset",
    "copy-window",
    W,
    "src_off, dst_off = seg.offset + done, pos + done",
    "src_off, dst_off = seg.offset + done, pos",
    SRC_CHECK,
    "every window written over the first",
)
mutant(
    "writer-hash-window",
    "copy-window",
    W,
    "hash_range(src, src_off, src_off + n, [h])",
    "hash_range(src, seg.offset, seg.offset + n, [h])",
    CONVERT,
    "digests of the first window only: check would pass a damaged file",
)
mutant(
    "writer-gather-row-offset",
    "copy-window",
    W,
    'self._emit(part, pos + a * seg.col_bytes, out, h, "gather")',
    'self._emit(part, pos, out, h, "gather")',
    SRC_CHECK,
    "row-parallel weights: chunks over each other",
)
mutant(
    "writer-gather-cols",
    "copy-window",
    W,
    "cols = rows[:, seg.col_offset : seg.col_offset + seg.col_bytes]",
    "cols = rows[:, : seg.col_bytes]",
    SRC_CHECK,
    "every rank gets rank 0's columns",
)
mutant(
    "writer-compute-chunk-pos",
    "copy-window",
    W,
    '            self._emit(job.part, pos, data, h, "compute")\n            pos += len(data)',
    '            self._emit(job.part, pos, data, h, "compute")',
    SRC_CHECK,
    "a cast tensor's chunks written over each other",
)
mutant(
    "writer-compute-column-piece",
    "copy-window",
    W,
    "rows = rows[:, p.start : p.start + p.length]",
    "rows = rows[:, : p.length]",
    SRC_CHECK,
    "a cast row-parallel weight: every rank gets rank 0's columns",
)
mutant(
    "writer-copy-piece-start",
    "copy-window",
    W,
    "out.append(Copy(path, info.offset + p.start * info.row_bytes, p.length * info.row_bytes))",
    "out.append(Copy(path, info.offset, p.length * info.row_bytes))",
    SRC_CHECK,
    "every rank copies the first rows",
)
mutant(
    "writer-replica-key",
    "copy-window",
    W,
    "key = (t.source, t.pieces, t.transforms, t.dtype)",
    "key = (t.source, t.transforms, t.dtype)",
    CONVERT,
    "tensors of one source on several ranks share one digest",
)
mutant(
    "writer-zeros-as-copy",
    "copy-window",
    W,
    "        if p.source is None:\n            out.append(Zeros(nbytes))",
    "        if p.source is None:\n            out.append(Compute(i, nbytes))",
    SRC_CHECK,
    "vocab padding rows are not zero",
)

# ---- multi-part shard directories and damage on a non-zero rank ----------------------------------------
mutant(
    "integrity-rank0-only",
    "rank-damage",
    INTEGRITY,
    "files = [(rank, name) for rank in ranks for name in m.rank_files(rank)]",
    "files = [(rank, name) for rank in list(ranks)[:1] for name in m.rank_files(rank)]",
    T_MULTIPART,
    "thread mode verifies rank 0's files only",
)
mutant(
    "integrity-first-part-only",
    "multi-part",
    INTEGRITY,
    "files = [(rank, name) for rank in ranks for name in m.rank_files(rank)]",
    "files = [(rank, name) for rank in ranks for name in m.rank_files(rank)[:1]]",
    T_MULTIPART,
    "damage in a later part of a rank goes unseen",
)
mutant(
    "integrity-skip-digests",
    "rank-damage",
    INTEGRITY,
    "if not problems and digests:",
    "if not problems and digests and False:",
    T_MULTIPART,
    "a damaged tensor is loaded",
)
mutant(
    "manifest-rank-files-first",
    "multi-part",
    "plamo2_tools/shards/manifest.py",
    "    def rank_files(self, rank: int) -> list[str]:\n",
    "    def rank_files(self, rank: int) -> list[str]:\n        return [self.ranks[rank].files[0]]\n",
    T_MULTIPART,
    "only the first part of each rank is loaded",
)

mutant(
    "integrity-size-check",
    "rank-damage",
    INTEGRITY,
    "if st.st_size != record.size:",
    "if st.st_size > record.size:",
    ("tests/cli/test_run_errors.py",),
    "a truncated file gets past the size check",
)
mutant(
    "integrity-header-rank",
    "rank-damage",
    INTEGRITY,
    'if key != "plamo2_tools_version" and meta.get(key) != want:',
    'if key == "format" and meta.get(key) != want:',
    ("tests/cli/test_run_errors.py",),
    "another rank's file loaded under this rank's name",
)

mutant(
    "integrity-refuse-multipart",
    "multi-part",
    INTEGRITY,
    "    files = [(rank, name) for rank in ranks for name in m.rank_files(rank)]\n",
    "    files = [(rank, name) for rank in ranks for name in m.rank_files(rank)]\n"
    "    if any(len(m.rank_files(r)) > 1 for r, _ in files):\n"
    '        raise CheckpointError(f"{m.path}: more than one file per rank")\n',
    T_MULTIPART,
    "every multi-part directory (plamo-2-8b at the default part size) refused",
)

mutant(
    "runtime-verify-rank0-only",
    "rank-damage",
    "plamo2_tools/runtime/rank/comm.py",
    'return [int(os.environ.get("RANK", "0"))] if mode == "dist" else list(range(world_size))',
    'return [int(os.environ.get("RANK", "0"))] if mode == "dist" else list(range(1))',
    T_MULTIPART,
    "thread ranks load the other ranks' files unverified",
)
mutant(
    "launch-verify-rank0-only",
    "rank-damage",
    "plamo2_tools/runtime/process/jobs.py",
    'verify_shard_files(manifest, range(world), digests=runtime.get("verify_files", True))\n    return world',
    'verify_shard_files(manifest, range(1), digests=runtime.get("verify_files", True))\n    return world',
    T_MULTIPART,
    "torchrun ranks start on damaged files (they skip their own check after the launcher's)",
)

# ---- sampling: against a recomputation from (seed, request, step) -----------------------------------
mutant(
    "graphs-first-step",
    "sampling",
    GRAPHS,
    "self.steps[idx] = 1  # the first token was step 0",
    "self.steps[idx] = 0  # the first token was step 0",
    T_SAMPLING,
    "the first two tokens share their noise",
)
mutant(
    "graphs-move-keys",
    "sampling",
    GRAPHS,
    "for t in (self.ids, self.pos, self.keys, self.steps, self.next, self.temp, self.top_p):",
    "for t in (self.ids, self.pos, self.steps, self.next, self.temp, self.top_p):",
    T_SAMPLING,
    "compaction loses the sampling key: output depends on the batch",
)
mutant(
    "graphs-move-steps",
    "sampling",
    GRAPHS,
    "for t in (self.ids, self.pos, self.keys, self.steps, self.next, self.temp, self.top_p):",
    "for t in (self.ids, self.pos, self.keys, self.next, self.temp, self.top_p):",
    T_SAMPLING,
    "compaction loses the step counter",
)
mutant(
    "graphs-steps-advance",
    "sampling",
    GRAPHS,
    "self.steps[:B].add_(1)",
    "self.steps[:B].add_(2)",
    T_SAMPLING,
    "step counter advances twice",
)
mutant(
    "gen-first-token-step",
    "sampling",
    GEN,
    "first = select_rows(logits, keys, torch.zeros(n, dtype=torch.long, device=dev), temps, tops, mode)",
    "first = select_rows(logits, keys, torch.ones(n, dtype=torch.long, device=dev), temps, tops, mode)",
    T_SAMPLING,
    "the first token draws step 1's noise",
)
mutant(
    "sampling-request-key-index",
    "sampling",
    SAMPLING,
    "return _signed(_mix_int(_mix_int(seed * _GOLDEN + 1) + index * _GOLDEN))",
    "return _signed(_mix_int(_mix_int(seed * _GOLDEN + 1) + index))",
    T_SAMPLING,
    "request streams not the documented hash",
)
mutant(
    "sampling-uniform-bits",
    "sampling",
    SAMPLING,
    "return (_shr(x, 40).to(torch.float32) + 0.5) * (1.0 / (1 << 24))",
    "return (_shr(x, 40).to(torch.float32) + 0.5) * (1.0 / (1 << 23))",
    T_SAMPLING,
    "uniforms outside (0, 1): NaN noise",
)
mutant(
    "sampling-gumbel-sign",
    "sampling",
    SAMPLING,
    "score = scaled + -torch.log(-torch.log(uniforms(keys, steps, logits.shape[-1])))",
    "score = scaled + torch.log(-torch.log(uniforms(keys, steps, logits.shape[-1])))",
    T_SAMPLING,
    "not the Gumbel distribution: wrong token frequencies",
)
mutant(
    "sampling-temperature",
    "sampling",
    SAMPLING,
    "scaled = logits.float() / torch.where(hot, t, torch.ones_like(t))[:, None]",
    "scaled = logits.float() * torch.where(hot, t, torch.ones_like(t))[:, None]",
    T_SAMPLING,
    "temperature inverted",
)
mutant(
    "sampling-top-p-strict",
    "sampling",
    SAMPLING,
    "keep_sorted = sorted_p.cumsum(-1) - sorted_p < top_p",
    "keep_sorted = sorted_p.cumsum(-1) < top_p",
    T_SAMPLING,
    "the nucleus drops the token that crosses top_p (top_p small: nothing kept)",
)
mutant(
    "sched-compact-skipped-key",
    "sampling",
    GEN,
    "            self.runner.move(src, free)\n",
    "",
    T_SAMPLING,
    "slot compaction moves the host's record but not the device's slot",
)

# ---- stop strings around sync boundaries and byte tokens ------------------------------------------------
mutant(
    "stop-window-short",
    "stop-strings",
    TEXT,
    "self.window = 4 * (max((len(s) for s in self.stops), default=0) + 1)",
    "self.window = max((len(s) for s in self.stops), default=0)",
    T_STOPS,
    "a stop string inside byte-fallback tokens is missed",
)
mutant(
    "stop-first-hit-tail",
    "stop-strings",
    TEXT,
    "tail = self.decode(tokens[max(0, checked - self.window) :])",
    "tail = self.decode(tokens[checked:])",
    T_STOPS,
    "a stop string straddling a sync boundary is missed",
)
mutant(
    "stop-first-hit-range",
    "stop-strings",
    TEXT,
    "return next((n for n in range(checked + 1, len(tokens) + 1) if self(i, tokens[:n])), None)",
    "return next((n for n in range(checked + 1, len(tokens)) if self(i, tokens[:n])), None)",
    T_STOPS,
    "a stop string in the last token of a span is missed",
)
mutant(
    "sched-first-stop-range",
    "stop-strings",
    SCHED,
    "return next((n for n in range(checked + 1, len(tokens) + 1) if stop(i, tokens[:n])), None)",
    "return next((n for n in range(checked + 2, len(tokens) + 1) if stop(i, tokens[:n])), None)",
    T_STOPS,
    "the first token after a sync is never checked",
)
mutant(
    "sched-checked-not-advanced",
    "stop-strings",
    SCHED,
    "        hit = first_stop(stop, r.index, r.tokens, r.checked)\n        r.checked = len(r.tokens)",
    "        hit = first_stop(stop, r.index, r.tokens, r.checked)\n        r.checked = 0",
    T_STOPS,
    "every drain re-decodes the whole answer (only the work grows)",
)
mutant(
    "sched-stop-keeps-one-more",
    "stop-strings",
    SCHED,
    'self._close(r, hit, "stop")',
    'self._close(r, hit + 1, "stop")',
    T_STOPS,
    "a token after the stop string is kept",
)
mutant(
    "text-stream-hold",
    "stop-strings",
    TEXT,
    "for n in range(min(len(s) - 1, len(text)), best, -1):",
    "for n in range(min(len(s) - 2, len(text)), best, -1):",
    T_STOPS,
    "the streamed text shows the start of a stop string",
)
mutant(
    "stops-finish-eos",
    "stop-strings",
    STOPS,
    "if tokens and tokens[-1] in set(stop_ids):",
    "if tokens and tokens[0] in set(stop_ids):",
    T_STOPS,
    "the EOS text reaches lm-eval",
)

mutant(
    "sched-eos-dropped",
    "scheduler",
    SCHED,
    '            r.stop_reason = token\n            self._close(r, len(r.tokens), "stop")',
    '            r.stop_reason = token\n            self._close(r, len(r.tokens) - 1, "stop")',
    ("tests/runtime/test_generation.py",),
    "the EOS token is not returned",
)

# ---- the lock ------------------------------------------------------------------------------------------
mutant(
    "lock-unlinked-accepted",
    "lock",
    LOCK,
    "            if _same_file(fd, self.path):\n                break",
    "            if True:\n                break",
    T_LOCK,
    "two writers in one directory",
)
mutant(
    "lock-reader-exclusive",
    "lock",
    LOCK,
    "fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)",
    "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)",
    T_LOCK,
    "readers refuse each other",
)
mutant(
    "lock-reader-oserror-refuses",
    "lock",
    LOCK,
    "        except OSError:\n            return\n        fcntl.flock(fd, fcntl.LOCK_UN)",
    '        except OSError:\n            raise OutputBusyError(f"{directory}: locked") from None\n'
    "        fcntl.flock(fd, fcntl.LOCK_UN)",
    T_LOCK,
    "readers on a file system without locks refused",
)
mutant(
    "lock-release-keeps-file",
    "lock",
    LOCK,
    "            self.path.unlink(missing_ok=True)\n",
    "            pass\n",
    T_LOCK,
    "a finished writer's lock looks like a dead writer's",
)
mutant(
    "lock-busy-exit",
    "lock",
    ERR,
    "class OutputBusyError(EnvironmentLimitError):",
    "class OutputBusyError(UserError):",
    T_LOCK,
    "a busy directory exits 2 instead of 3",
)

# ---- error mapping and durability ----------------------------------------------------------------------
mutant(
    "errors-enospc-bug",
    "errors",
    CLI_ERR,
    "            if e.errno not in ENVIRONMENT_ERRNOS:\n                _bug(fn.__name__)",
    "            if e.errno not in ENVIRONMENT_ERRNOS or e.errno == 28:\n                _bug(fn.__name__)",
    T_ERRORS,
    "a full disk reported as a bug (exit 70)",
)
mutant(
    "errors-enospc-missing",
    "errors",
    ERR,
    "        errno.ENOSPC,\n",
    "",
    T_ERRORS,
    "ENOSPC exits 2 or 70",
)
mutant(
    "errors-memoryerror-bug",
    "errors",
    CLI_ERR,
    "        except MemoryError as e:\n            error_line(out_of_memory_line(e))\n"
    "            raise typer.Exit(3) from None",
    "        except MemoryError as e:\n            _bug(fn.__name__)",
    T_ERRORS,
    "host OOM reported as a bug",
)
mutant(
    "errors-torch-oom-bug",
    "errors",
    CLI_ERR,
    "            if is_out_of_memory(e):",
    "            if isinstance(e, MemoryError):",
    T_ERRORS,
    "CUDA OOM reported as a bug (exit 70)",
)
mutant(
    "errors-environment-code",
    "errors",
    ERR,
    '    """The machine said no: not enough disk, permission denied, ..."""\n\n    exit_code = 3',
    '    """The machine said no: not enough disk, permission denied, ..."""\n\n    exit_code = 2',
    T_ERRORS,
    "environment refusals exit 2",
)
mutant(
    "writer-enospc-as-io",
    "errors",
    W,
    "                if e.errno == errno.ENOSPC:\n                    raise EnvironmentLimitError",
    "                if e.errno == errno.ENOSPC:\n                    raise CheckpointError",
    T_ERRORS,
    "a full disk during a kernel copy exits 2",
)
mutant(
    "sio-no-fsync",
    "durability",
    SIO,
    "            os.fsync(self.fd)\n",
    "            pass\n",
    T_DURABLE,
    "a power cut after the rename leaves a file of zeros",
)
mutant(
    "sio-no-dir-fsync",
    "durability",
    SIO,
    "            fsync_dir(self.path.parent)\n",
    "            pass\n",
    T_DURABLE,
    "a power cut loses the rename",
)
mutant(
    "engine-partial-not-removed",
    "durability",
    ENGINE,
    '        (out / f"{name}.partial").unlink(missing_ok=True)\n',
    "        pass\n",
    T_DURABLE,
    "a re-run after a kill refuses its own .partial files",
)
mutant(
    "outputs-siblings",
    "durability",
    OUTPUTS,
    'SIBLINGS = (".partial", ".tmp")',
    'SIBLINGS = (".partial",)',
    T_DURABLE,
    "a user's *.tmp file is overwritten",
)

mutant(
    "engine-side-file-no-fsync",
    "durability",
    "plamo2_tools/safe_files.py",
    "            if durable:\n                os.fsync(fd_out)",
    "            pass",
    T_DURABLE,
    "config.json renamed into place before its bytes are on disk",
)
mutant(
    "outputs-remove-siblings",
    "durability",
    OUTPUTS,
    "for candidate in (name, *(name + s for s in SIBLINGS)):",
    "for candidate in (name,):",
    T_DURABLE,
    "a re-run with other options refuses the killed run's own .partial files",
)

mutant(
    "errors-os-error-swapped",
    "errors",
    ERR,
    "cls = EnvironmentLimitError if e.errno in ENVIRONMENT_ERRNOS else UserError",
    "cls = UserError if e.errno in ENVIRONMENT_ERRNOS else EnvironmentLimitError",
    T_ERRORS,
    "a full disk blamed on the user, a missing file on the machine",
)

# ---- tokenizer pair inputs -------------------------------------------------------------------------------
HF = "plamo2_tools/tokenizer/hf.py"
T_ENC = ("tests/tokenizer/test_encoder.py",)
mutant(
    "hf-pair-no-second-bos",
    "tokenizer",
    HF,
    "            output = output + bos + token_ids_1 + eos",
    "            output = output + token_ids_1 + eos",
    T_PAIR,
    "no BOS before the second sequence of a pair",
)
mutant(
    "hf-pair-mask",
    "tokenizer",
    HF,
    "            mask += bos + [0] * len(token_ids_1) + eos",
    "            mask += [0] * len(token_ids_1) + eos",
    T_PAIR,
    "special-token mask misaligned on pairs",
)
mutant(
    "hf-pair-eos-first",
    "tokenizer",
    HF,
    "        output = bos + token_ids_0 + eos\n",
    "        output = bos + token_ids_0\n",
    T_PAIR,
    "no EOS after the first sequence with add_eos_token",
)
mutant(
    "enc-dp-tie",
    "tokenizer",
    ENC,
    "                if value < best:",
    "                if value <= best:",
    T_ENC,
    "ties resolved to the shorter piece: not PLaMo's ids",
)
mutant(
    "enc-walk-step",
    "tokenizer",
    ENC,
    "            i -= neg_length",
    "            i += 1",
    T_ENC,
    "pieces overlap: garbage ids",
)
mutant(
    "enc-byte-fallback",
    "tokenizer",
    ENC,
    '        return [self.tables.byte_ids[b] for b in char.encode("utf-8")]',
    '        return [self.tables.byte_ids[b] for b in char.encode("utf-8")[:1]]',
    T_ENC,
    "multi-byte fallback keeps the first byte only",
)
mutant(
    "enc-bounds",
    "tokenizer",
    ENC,
    "bounds = [k for k in range(1, len(text)) if text[k - 1 : k + 1] not in pairs]",
    "bounds = [k for k in range(1, len(text)) if text[k - 1 : k + 1] in pairs]",
    T_ENC,
    "texts cut inside pieces",
)
mutant(
    "enc-filler",
    "tokenizer",
    ENC,
    'filler += len(text[i].encode("utf-8")) - 1',
    'filler += len(text[i].encode("utf-8"))',
    T_ENC,
    "PLaMo's trailing zeros miscounted",
)

# ---- hostile checkpoints and batch files (issue 28) ------------------------------------------------------
# Each reverts one fix of issue 28 §2-§3; its test (tests/security/) runs the real CLI on the input.
HOSTILE = "tests/security/test_hostile_models.py"
BATCH = "tests/security/test_batch_output.py"
P3 = "plamo2_tools/model/plamo3/config.py"
VOCAB = "plamo2_tools/tokenizer/vocab.py"
FILE_OUT = "plamo2_tools/file_output.py"
BATCH_PY = "plamo2_tools/serve/batch.py"
mutant(
    "hostile-error-lines-kept",
    "hostile",
    CLI_ERR,
    "{escape(one_line(message))}",
    "{escape(message)}",
    (HOSTILE, "-k spanning_lines"),
    "a library's message of several lines printed as several lines",
)
mutant(
    "hostile-config-bounds-late",
    "hostile",
    P3,
    '                raise ConfigError(f"{source}: {key} = {shown_int(values[key])}: {problem}")',
    "                pass",
    (HOSTILE, "-k pattern-0 or layers-1e9"),
    "sliding_window_pattern 0: ZeroDivisionError; 1e9 layers: all memory",
)
mutant(
    "hostile-yarn-equal-betas",
    "hostile",
    P3,
    "    if not rope.beta_fast > rope.beta_slow:",
    "    if rope.beta_fast < rope.beta_slow:",
    (HOSTILE, "-k yarn-beta-equal"),
    "a YaRN config every run crashes on passes convert and check",
)
mutant(
    "hostile-rope-type-ignored",
    "hostile",
    P3,
    "        if value is not None and not isinstance(value, dict):",
    "        if False:",
    (HOSTILE, "-k scaling-str or parameters-list"),
    "rope_scaling as a string silently runs without YaRN",
)
mutant(
    "hostile-tokenizer-score-overflow",
    "hostile",
    VOCAB,
    "    if math.isfinite(value) and not (math.isfinite(value * 1e4)",
    "    if False and not (math.isfinite(value * 1e4)",
    (HOSTILE, "-k score-1e308"),
    "score 1e308: OverflowError (exit 70)",
)
mutant(
    "hostile-tokenizer-surrogate",
    "hostile",
    VOCAB,
    "    if not piece.isascii():",
    "    if False:",
    (HOSTILE, "-k surrogate"),
    "a lone surrogate passes tokenize and convert, then crashes every decode",
)
mutant(
    "hostile-tokenizer-piece-length",
    "hostile",
    VOCAB,
    "    if len(piece) > MAX_PIECE_CHARS:",
    "    if False:",
    (HOSTILE, "-k piece-1e6"),
    "a million-character piece: quadratic memory (or only the total's vaguer line)",
)
mutant(
    "hostile-manifest-stages",
    "hostile",
    "plamo2_tools/shards/manifest.py",
    "    _check_stages(mapping, int(config.num_hidden_layers))\n",
    "",
    (HOSTILE, "-k stages"),
    "stages past the layers: exit 70; short of them: a model with fewer layers runs",
)
mutant(
    "hostile-check-ignores-records",
    "hostile",
    "plamo2_tools/shards/check.py",
    "            if record and not bad:",
    "            if False:",
    (HOSTILE, "-k disagrees_with_its_file"),
    "check passes a directory every load refuses",
)
mutant(
    "hostile-source-library-error",
    "hostile",
    "plamo2_tools/shards/source_check.py",
    "    except Exception as e:  # noqa: BLE001 - the library's own word on a damaged file is the message",
    "    except ZeroDivisionError as e:  # noqa: BLE001",
    (HOSTILE, "-k truncated_source"),
    "check --source on a truncated source: exit 70",
)
mutant(
    "hostile-force-no-hint",
    "hostile",
    ENGINE,
    "        raise untrusted_record(e, out) from None",
    "        raise",
    (HOSTILE, "-k how_to_clear"),
    "refused without saying how to clear the way",
)
mutant(
    "hostile-piece-axis-unchecked",
    "hostile",
    "plamo2_tools/shards/manifest.py",
    "            if cut >= len(shape):",
    "            if False:",
    (HOSTILE + "::test_manifest_piece_along_an_axis_the_tensor_lacks",),
    "resharding a manifest whose record lost its shape: IndexError (exit 70)",
)
mutant(
    "batch-foreign-output-taken",
    "batch",
    FILE_OUT,
    "            if head and not is_ours(head):",
    "            if False:",
    (BATCH, "-k never_overwritten"),
    "a user's file replaced by results",
)
mutant(
    "batch-temporary-followed",
    "batch",
    FILE_OUT,
    "        fd = create_fresh(self.tmp, os.O_WRONLY)",
    "        fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)",
    (BATCH, "-k temporary_link"),
    "results written through a planted link, outside",
)
mutant(
    "batch-dangling-link-followed",
    "batch",
    FILE_OUT,
    "        if not target.exists():",
    "        if False:",
    (BATCH, "-k dangling"),
    "a file created wherever a dangling --output link points",
)
mutant(
    "batch-resume-ignores-run",
    "batch",
    BATCH_PY,
    "        differs = header_differences(old, self.header)",
    "        differs = []",
    (BATCH, "-k another_model_or_settings"),
    "another model's answers kept as this run's",
)
mutant(
    "batch-lock-per-process",
    "batch",
    FILE_OUT,
    'name=f".{self.path.name}.plamo2.lock"',
    'name=f".{self.path.name}.{os.getpid()}.lock"',
    (BATCH, "-k second_writer"),
    "two writers of one output both do the whole file",
)
mutant(
    "batch-no-context-cap",
    "batch",
    BATCH_PY,
    "    return min(int(max_context or DEFAULT_MAX_CONTEXT), positions)",
    "    return positions",
    (BATCH, "-k beyond_memory"),
    "one line's max_tokens sizes the KV cache",
)
mutant(
    "batch-oom-wrapped",
    "batch",
    BATCH_PY,
    "                raise engine.loop.error from None",
    "                raise",
    (BATCH, "-k beyond_memory"),
    "out of memory reported as a bug (exit 70)",
)


# ---- issue 34: the classes an independent audit found unguarded (one prefix per class) --------------------------
HANDLERS = "plamo2_tools/serve/handlers.py"
PROMPTS = "plamo2_tools/serve/prompts.py"
T_CHOICES = ("tests/serve/test_real_choices.py",)
mutant(
    "choice-echo-modulo",
    "choices",
    HANDLERS,
    "echo[i // req.n],",
    "echo[i % req.n],",
    T_CHOICES,
    "choice i echoes the prompt of i % n: another prompt's text before the answer",
)
mutant(
    "choice-prompt-ids-modulo",
    "choices",
    HANDLERS,
    "prompts[i // req.n].token_ids if req.return_token_ids else None",
    "prompts[i % req.n].token_ids if req.return_token_ids else None",
    T_CHOICES,
    "prompt_token_ids of another prompt",
)
mutant(
    "choice-fanout-order",
    "choices",
    PROMPTS,
    "        for p, prompt in enumerate(prompts)\n        for j in range(n)\n",
    "        for j in range(n)\n        for p, prompt in enumerate(prompts)\n",
    T_CHOICES,
    "choices in choice-major order: choice i answers another prompt than its echo",
)
mutant(
    "choice-stream-zero",
    "choices",
    PROMPTS,
    "            stream=j,",
    "            stream=0,",
    T_CHOICES,
    "every choice of a prompt draws the same tokens (n copies of one answer)",
)
mutant(
    "choice-stream-chunk-index",
    "choices",
    HANDLERS,
    "            index=i,\n            text=text,\n            logprobs=lp,\n",
    "            index=i // req.n,\n            text=text,\n            logprobs=lp,\n",
    T_CHOICES,
    "streamed chunks labelled with the prompt's index: a client merges choices",
)
mutant(
    "choice-prompt-ids-once",
    "choices",
    HANDLERS,
    "            if i not in sent_prompt_ids:",
    "            if not sent_prompt_ids:",
    T_CHOICES,
    "a stream sends prompt_token_ids with the first choice only",
)
mutant(
    "choice-usage-per-choice",
    "choices",
    HANDLERS,
    "job = Job(run, cid, model, [len(p.token_ids) for p in prompts], include_usage, kind, state=state)",
    "job = Job(run, cid, model, [len(r.prompt_token_ids) for r in requests], include_usage, kind, state=state)",
    T_CHOICES,
    "usage counts each prompt n times",
)

ROPE3 = "plamo2_tools/model/plamo3/rope.py"
LAYERS3 = "plamo2_tools/model/plamo3/layers.py"
T_YARN = ("tests/model/test_yarn_constants.py",)
mutant(
    "yarn-no-2pi",
    "yarn",
    ROPE3,
    "(rotations * 2 * math.pi)",
    "(rotations * math.pi)",
    T_YARN,
    "the correction range counts half-turns: the ramp starts at other dimensions",
)
mutant(
    "yarn-ramp-reversed",
    "yarn",
    ROPE3,
    "keep = 1.0 - ramp",
    "keep = ramp",
    T_YARN,
    "high frequencies interpolated, low ones kept: the opposite of YaRN",
)
mutant(
    "yarn-betas-swapped",
    "yarn",
    ROPE3,
    "low = correction_dim(rope.beta_fast, dim,",
    "low = correction_dim(rope.beta_slow, dim,",
    T_YARN,
    "the ramp collapses to a step at beta_slow's dimension",
)
mutant(
    "yarn-no-mscale",
    "yarn",
    ROPE3,
    "scale = 0.1 * math.log(rope.yarn_factor) + 1.0 if rope.yarn_factor > 1 else 1.0",
    "scale = 1.0",
    T_YARN,
    "no attention factor: q.k too small by (0.1 ln f + 1)^2",
)
mutant(
    "yarn-mscale-without-one",
    "yarn",
    ROPE3,
    "scale = 0.1 * math.log(rope.yarn_factor) + 1.0 if",
    "scale = 0.1 * math.log(rope.yarn_factor) if",
    T_YARN,
    "cos and sin scaled by ln(f)/10: attention almost uniform",
)
mutant(
    "yarn-factor-multiplied",
    "yarn",
    ROPE3,
    "interpolation = 1.0 / (rope.yarn_factor * pos_freqs)",
    "interpolation = rope.yarn_factor / pos_freqs",
    T_YARN,
    "interpolated frequencies multiplied by the factor instead of divided",
)
mutant(
    "yarn-truncate-inverted",
    "yarn",
    ROPE3,
    "    if rope.truncate:",
    "    if not rope.truncate:",
    T_YARN,
    "PFN's truncate=False rounded like vLLM's default",
)
mutant(
    "yarn-clamp-half-head",
    "yarn",
    ROPE3,
    "min(high, dim - 1.0)",
    "min(high, dim // 2 - 1.0)",
    T_YARN,
    "the range clamped to the frequency count, not the head dimension",
)
mutant(
    "yarn-runtime-no-scale",
    "yarn",
    LAYERS3,
    "self.rope_freqs[kind] = (freqs.to(device), scale, rope.theta)",
    "self.rope_freqs[kind] = (freqs.to(device), 1.0, rope.theta)",
    T_YARN,
    "the runtime drops YaRN's magnitude (the reference keeps it)",
)
mutant(
    "yarn-runtime-plain-frequencies",
    "yarn",
    LAYERS3,
    "rope_cos_sin(batch.positions, d, theta, torch.float32, freqs, scale)",
    "rope_cos_sin(batch.positions, d, theta, torch.float32, None, scale)",
    T_YARN,
    "the runtime rotates with theta's plain frequencies on YaRN layers",
)

NUMERICS = "plamo2_tools/numerics.py"
T_BITS = ("tests/convert/test_numerics_bits.py",)
mutant(
    "bits-nonzero-sign-mask",
    "bits",
    NUMERICS,
    "sign = np.array(1 << (8 * dtype.itemsize - 1), x.dtype)",
    "sign = np.array(1 << (8 * dtype.itemsize - 2), x.dtype)",
    T_BITS,
    "check's padding test masks an exponent bit: non-zero padding passes",
)
mutant(
    "bits-nonzero-no-mask",
    "bits",
    NUMERICS,
    "return int(np.count_nonzero(x & ~sign))",
    "return int(np.count_nonzero(x))",
    T_BITS,
    "-0.0 padding (bfloat16, float8) reported as damage",
)
mutant(
    "bits-nonzero-all-uint",
    "bits",
    NUMERICS,
    'if dtype.storage.startswith("uint") and dtype.is_floating_point:',
    'if dtype.storage.startswith("uint"):',
    T_BITS,
    "uint8 values of 128 counted as zero",
)
mutant(
    "bits-f16-quiet-bit",
    "bits",
    NUMERICS,
    "out.view(np.uint32)[nan] |= np.uint32(0x00400000)",
    "out.view(np.uint32)[nan] |= np.uint32(0x00200000)",
    T_BITS,
    "float16 NaN widened with a payload bit set instead of the quiet bit",
)
mutant(
    "bits-f16-not-quieted",
    "bits",
    NUMERICS,
    "        if nan.any():  # numpy keeps a signalling NaN signalling; the instruction quiets it",
    "        if False:  # numpy keeps a signalling NaN signalling; the instruction quiets it",
    T_BITS,
    "signalling float16 NaN stay signalling: other bytes than torch's",
)
mutant(
    "bits-bf16-no-tie-bit",
    "bits",
    NUMERICS,
    "out = ((bits + (np.uint32(0x7FFF) + ((bits >> 16) & 1))) >> 16).astype(np.uint16)",
    "out = ((bits + np.uint32(0x7FFF)) >> 16).astype(np.uint16)",
    T_BITS,
    "ties of odd bfloat16 values round down: not round-to-even",
)
mutant(
    "bits-f16-nan-payload",
    "bits",
    NUMERICS,
    "| 0x7E00 | ((bits >> 13) & 0x3FF)",
    "| 0x7E00 | ((bits >> 12) & 0x3FF)",
    T_BITS,
    "float32 NaN payloads shifted into float16 one bit off",
)
mutant(
    "bits-f8-subnormal",
    "bits",
    NUMERICS,
    "v = sign * m * 2.0 ** (1 - bias - man_bits)",
    "v = sign * m * 2.0 ** (-bias - man_bits)",
    T_BITS,
    "float8 subnormals half their value",
)
mutant(
    "bits-narrow-nan-to-bf16",
    "bits",
    NUMERICS,
    "out[np.isnan(wide)] = _NAN_NARROW_TO_BF16",
    "out[np.isnan(wide)] = _NAN_F32_TO_BF16",
    T_BITS,
    "float16/float8 NaN cast to bfloat16 with float32's NaN bits",
)

JSONIO = "plamo2_tools/jsonio.py"
T_JSON = ("tests/test_jsonio.py",)
MANIFEST = "plamo2_tools/shards/manifest.py"
T_MANIFEST = ("tests/shards/test_manifest_counts.py",)
T_BOOLS = ("tests/serve/test_bool_is_not_int.py",)
mutant(
    "valid-json-objects-not-pushed",
    "validators",
    JSONIO,
    "stack += [(x, d + 1) for x in v if isinstance(x, (dict, list))]",
    "stack += [(x, d + 1) for x in v if isinstance(x, list)]",
    T_JSON,
    "objects inside arrays are not looked into: a deep tree of them passes the limit",
)
mutant(
    "valid-json-objects-ignored",
    "validators",
    JSONIO,
    "        if isinstance(v, dict):\n            v = list(v.values())\n",
    "",
    T_JSON,
    "objects are no level at all: objects nested in objects pass any limit",
)
mutant(
    "valid-json-off-by-one",
    "validators",
    JSONIO,
    "if depth(value) > max_depth:",
    "if depth(value) > max_depth + 1:",
    T_JSON,
    "one level more than documented",
)
mutant(
    "valid-decode-bool",
    "validators",
    "plamo2_tools/tokenizer/cli_io.py",
    "all(isinstance(v, int) and not isinstance(v, bool) for v in value)",
    "all(isinstance(v, int) for v in value)",
    ("tests/tokenizer/test_loader_cli.py",),
    "tokenize --decode takes [true] as BOS",
)
mutant(
    "valid-format-version-bool",
    "validators",
    "plamo2_tools/shards/formats.py",
    "if not isinstance(version, int) or isinstance(version, bool) or version not in FORMATS:",
    "if not isinstance(version, int) or version not in FORMATS:",
    T_MANIFEST,
    "format_version true read as format 1",
)
mutant(
    "valid-manifest-count-bool",
    "validators",
    MANIFEST,
    "if not isinstance(value, int) or isinstance(value, bool) or value < least:",
    "if not isinstance(value, int) or value < least:",
    T_MANIFEST,
    "true read as a count of 1",
)
mutant(
    "valid-manifest-count-least",
    "validators",
    MANIFEST,
    "if not isinstance(value, int) or isinstance(value, bool) or value < least:",
    "if not isinstance(value, int) or isinstance(value, bool) or value < 0:",
    T_MANIFEST,
    "tp_size, max_part_size, padded_vocab of 0 accepted",
)
mutant(
    "valid-manifest-int-size",
    "validators",
    MANIFEST,
    '_count(rec["size"]), str(rec[key]), _count(rec["rank"]), _count(rec["part"])',
    'int(rec["size"]), str(rec[key]), _count(rec["rank"]), _count(rec["part"])',
    T_MANIFEST,
    "a negative file size read (check then reports damage, exit 1, instead of a malformed manifest)",
)
mutant(
    "valid-manifest-int-tp",
    "validators",
    MANIFEST,
    '_count(m["tp_size"], 1), _count(m["pp_size"], 1)',
    'int(m["tp_size"]), _count(m["pp_size"], 1)',
    T_MANIFEST,
    "tp_size 1.5 or true read as 1",
)
mutant(
    "valid-manifest-flag",
    "validators",
    MANIFEST,
    '_flag(o["tied_embeddings"])',
    'bool(o["tied_embeddings"])',
    T_MANIFEST,
    'tied_embeddings "false" read as true',
)
mutant(
    "valid-serve-not-strict",
    "validators",
    "plamo2_tools/serve/protocol.py",
    'class _Request(BaseModel):\n    model_config = ConfigDict(strict=True, extra="allow")',
    'class _Request(BaseModel):\n    model_config = ConfigDict(strict=False, extra="allow")',
    T_BOOLS,
    "max_tokens true served as 1, echo 1 as true",
)
mutant(
    "valid-serve-token-bool",
    "validators",
    "plamo2_tools/serve/protocol.py",
    "return isinstance(v, list) and all(type(t) is int for t in v)",
    "return isinstance(v, list) and all(isinstance(t, int) for t in v)",
    T_BOOLS,
    "prompt [true, 5] served as token ids [1, 5]",
)

T_SCHED = ("tests/runtime/test_scheduler_choices.py",)
mutant(
    "sched-burst-pending-swapped",
    "scheduler",
    SCHED,
    "return max(1, min(k, min(left) if self.pending else max(left)))",
    "return max(1, min(k, max(left) if self.pending else min(left)))",
    T_SCHED,
    "waiting requests wait a whole look interval for a freed slot; without waiters, extra looks",
)
mutant(
    "sched-burst-min-always",
    "scheduler",
    SCHED,
    "return max(1, min(k, min(left) if self.pending else max(left)))",
    "return max(1, min(k, min(left)))",
    T_SCHED,
    "a look at every request's end even when nobody waits",
)
mutant(
    "sched-burst-max-always",
    "scheduler",
    SCHED,
    "return max(1, min(k, min(left) if self.pending else max(left)))",
    "return max(1, min(k, max(left)))",
    T_SCHED,
    "freed slots stay idle while requests wait",
)
mutant(
    "sched-burst-no-interval",
    "scheduler",
    SCHED,
    "return max(1, min(k, min(left) if self.pending else max(left)))",
    "return max(1, min(left) if self.pending else max(left))",
    T_SCHED,
    "no look for hundreds of steps: stop strings and EOS found late, streams stall",
)
mutant(
    "sched-burst-while-admitting",
    "scheduler",
    GEN,
    "burst = 1 if waiting else sched.burst(k)",
    "burst = sched.burst(k)",
    T_SCHED,
    "a prefill group waits for a whole burst of decode steps",
)
mutant(
    "sched-cancel-stays-pending",
    "scheduler",
    SCHED,
    "        if index in self.pending:\n            self.pending.remove(index)\n",
    "",
    T_SCHED,
    "a cancelled waiting request is admitted, prefilled and holds a slot later",
)

TEXT_PY = "plamo2_tools/runtime/batching/text.py"
T_EOS = ("tests/runtime/test_stop_ids.py",)
mutant(
    "eos-config-json-too",
    "eos",
    TEXT_PY,
    "            break\n    return tuple(dict.fromkeys(ids))",
    "    return tuple(dict.fromkeys(ids))",
    T_EOS,
    "config.json's EOS ends generations although generation_config.json says otherwise",
)
mutant(
    "eos-config-json-first",
    "eos",
    TEXT_PY,
    'for name in ("generation_config.json", "config.json"):',
    'for name in ("config.json", "generation_config.json"):',
    T_EOS,
    "config.json's EOS instead of generation_config.json's",
)
mutant(
    "eos-no-tokenizer-id",
    "eos",
    TEXT_PY,
    '    if getattr(tokenizer, "eos_token_id", None) is not None:',
    "    if False:",
    T_EOS,
    "the tokenizer's EOS does not end a generation",
)
mutant(
    "eos-sorted",
    "eos",
    TEXT_PY,
    "return tuple(dict.fromkeys(ids))",
    "return tuple(sorted(set(ids)))",
    T_EOS,
    "EOS ids reordered (the first is the one lm-eval decodes as its stop string)",
)
mutant(
    "eos-first-of-list",
    "eos",
    TEXT_PY,
    "[int(x) for x in eos or []]",
    "[int(x) for x in (eos or [])[:1]]",
    T_EOS,
    "only the first of generation_config's EOS ids ends a generation",
)


if __name__ == "__main__":
    main()
