"""Batch generation from files: `plamo2-tools generate SHARDS --input requests.jsonl --output results.jsonl`.

Each input line is a request: a JSON object with /v1/completions' fields (prompt as text or token
ids, max_tokens, temperature, top_p, seed, stop, n, logprobs, echo, ignore_eos), a JSON string (the
prompt), or, when it is not JSON at all, the line's text itself.  Blank lines are skipped.  A line
leaves out what the command line gives as defaults (`--max-new-tokens`, `--temperature`,
`--top-p`); a sampled line without a seed gets one derived from `--seed` and its line, so a
re-run draws the same tokens.

Everything runs the way the server runs it: the requests go into one online loop
(`RuntimeEngine`: continuous batching, the checkpoint's EOS ids, stop strings cut by the runtime's
`TextStream`, logprobs from one scoring pass), and each result is the server's completion object
(`responses.CompletionChoiceState`), without its id and time, plus `index` (the line's 0-based
number in the file), `token_ids` per choice and `input_sha256` (of the input line).

Results are appended as requests finish, one JSON line each, after a first line, the run's header:
`{"format": "plamo2-batch-results", "version": 1, "model": ..., "settings": {...}}`, which names
what determines every answer besides the line itself: the model (a digest of the shard files and
side files the manifest records) and the command line's defaults (`--max-new-tokens`,
`--temperature`, `--top-p`, `--seed`) and runtime options.  The output file is the rule of
`file_output.SingleFileOutput`: ours (that header first) or absent or empty, never someone else's;
locked for the whole run; replaced only whole, by rename from a temporary created fresh.

Re-running with the same --output resumes: lines whose record is there (for the same input line)
are skipped, a cut last line (a kill in mid-write) is dropped, error records are retried, records
of lines that changed are redone.  A file whose header names another model or other settings is
refused (one line naming what differs): its answers would not be this run's, and they are not
ours to throw away; a file of ours that holds no record yet is simply started again.  Once every
line is done the file is rewritten in line order (atomically), so a resumed run leaves the same
file as a clean one.  A line that cannot run (bad JSON, a wrong field, a prompt beyond the context
cap `--max-context`, ...) is reported with its line number and gets an error record; the others
still run (`strict`: refused up front instead).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ..errors import CheckpointError, OutputExistsError, UserError, os_error
from ..file_output import SingleFileOutput
from ..jsonio import parse_json
from ..runtime.batching.engine import Runtime
from ..runtime.batching.online import DEFAULT_MAX_CONTEXT
from ..safe_files import write_all
from .engine_api import EngineError, ModelInfo, TokenEvent
from .prompts import Prompt, Sampling, check_token_ids, fan_out, resolve_max_tokens
from .protocol import ApiError, CompletionRequest, validation_message
from .responses import CompletionChoiceState, usage
from .runtime_engine import LoopOptions, RuntimeEngine
from .service import follow

SEED_MASK = 2**63 - 1
FORMAT, VERSION = "plamo2-batch-results", 1
# How a header's settings are named on the command line (a refused resume names what differs).
SETTING_OPTIONS = {
    "max_tokens": "--max-new-tokens",
    "temperature": "--temperature",
    "top_p": "--top-p",
    "seed": "--seed",
    "options": "runtime options",
}


@dataclass
class Defaults:
    """What a line leaves out (the command line's --max-new-tokens, --temperature, --top-p, --seed)."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


@dataclass
class Line:
    index: int  # 0-based line number in the file
    sha256: str
    request: CompletionRequest | None = None
    prompts: list[Prompt] = field(default_factory=list)
    error: str | None = None

    @property
    def number(self) -> int:
        return self.index + 1


@dataclass
class BatchSummary:
    lines: int  # requests in the file (non-blank lines)
    skipped: int  # already done in --output
    ran: int
    errors: list[tuple[int, str]]  # (line number, message)
    generated_tokens: int
    seconds: float
    output: str


def line_seed(base: int, index: int) -> int:
    """The seed of a sampled line that names none: fixed by (--seed, line), distinct per line."""
    digest = hashlib.sha256(f"{base}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & SEED_MASK


def parse_line(text: str, index: int, defaults: Defaults) -> Line:
    """One input line as a request (tokenised later); `error` says why it cannot run."""
    line = Line(index, hashlib.sha256(text.encode()).hexdigest())
    stripped = text.strip()
    try:
        value: Any = json.loads(stripped)
    except json.JSONDecodeError as e:
        if stripped[:1] in '{["':  # meant as JSON
            line.error = f"not valid JSON: {e.msg} (column {e.colno})"
            return line
        value = text.rstrip("\r\n")
    except (RecursionError, ValueError) as e:  # nested past Python's recursion; a 5000-digit number
        line.error = "not valid JSON: " + ("nested too deeply" if isinstance(e, RecursionError) else str(e))
        return line
    if isinstance(value, str):
        value = {"prompt": value}
    if not isinstance(value, dict):
        line.error = "a line must be a JSON object, a JSON string or a plain text prompt"
        return line
    body = {"max_tokens": defaults.max_tokens, "temperature": defaults.temperature, "top_p": defaults.top_p, **value}
    try:
        req = CompletionRequest.model_validate(body)
    except ValidationError as e:
        line.error = validation_message(e)[0]
        return line
    bad = req.unsupported()
    if bad:
        line.error = f"`{bad}` is not supported"
    elif req.stream:
        line.error = "stream is for the server; a batch file writes whole results"
    if req.seed is None and req.temperature > 0:
        req = req.model_copy(update={"seed": line_seed(defaults.seed, index)})
    line.request = req
    return line


def read_lines(path: Path, defaults: Defaults) -> list[Line]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise os_error(e, f"--input {path}: cannot read") from None
    except UnicodeDecodeError as e:
        raise UserError(f"--input {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    return [parse_line(t, i, defaults) for i, t in enumerate(text.splitlines()) if t.strip()]


def tokenize_lines(lines: list[Line], tokenizer: Any, info: ModelInfo, positions: int | None = None) -> None:
    """Prompts to token ids (text gets BOS as the tokenizer config says, like the server's), checked
    against the vocabulary and the context cap `info.max_context` (`positions`: the model's own,
    named when the cap is lower)."""
    for line in lines:
        if line.error is not None or line.request is None:
            continue
        try:
            prompts = []
            for k, p in enumerate(line.request.prompt):
                if p == "":
                    raise ApiError(400, f"prompt {k} is empty")
                ids = list(tokenizer(p)["input_ids"]) if isinstance(p, str) else list(p)
                check_token_ids(ids, info, f"prompt {k}")
                prompts.append(
                    Prompt(
                        ids,
                        p if isinstance(p, str) else None,
                        resolve_max_tokens(len(ids), line.request.max_tokens, info),
                    )
                )
            if line.request.logprobs is not None and line.request.logprobs > info.max_logprobs:
                raise ApiError(400, f"logprobs must be at most {info.max_logprobs}")
            line.prompts = prompts
        except ApiError as e:
            line.error = e.message
            if e.code == "context_length_exceeded" and positions is not None and info.max_context < positions:
                line.error += f" (the cap is --max-context {info.max_context}; the model allows {positions})"


# ---- the results file ---------------------------------------------------------------------------------
def model_digest(manifest: Any) -> str:
    """What identifies the model a batch ran on: the digests the shard directory's manifest records
    for every shard file and copied side file (tokenizer included), in its hash."""
    files = {name: rec.digest for name, rec in sorted(manifest.files.items())}
    sides = {name: rec.digest for name, rec in sorted(manifest.side_files.items())}
    text = json.dumps({"hash": str(manifest.hash), "files": files, "side_files": sides}, sort_keys=True)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def run_header(manifest: Any, defaults: dict[str, Any], options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The first line of a results file: everything besides a line's own text that its answer
    depends on (the model, the command line's defaults for what a line leaves out, runtime options)."""
    d = Defaults(**defaults)
    settings = {
        "max_tokens": d.max_tokens,
        "temperature": float(d.temperature),
        "top_p": float(d.top_p),
        "seed": d.seed,
        "options": dict(sorted((options or {}).items())),
    }
    return {"format": FORMAT, "version": VERSION, "model": model_digest(manifest), "settings": settings}


def _first_line(data: bytes) -> Any:
    try:
        return parse_json(data.split(b"\n", 1)[0], "--output")
    except CheckpointError:
        return None


def _record(text: str) -> Any:
    """A record line of a results file; None for a line cut by a kill (or anything else unreadable)."""
    try:
        return parse_json(text, "--output")
    except CheckpointError:
        return None


def is_results_file(head: bytes) -> bool:
    """A results file of ours: its first line is a header we wrote (any version)."""
    first = _first_line(head)
    return isinstance(first, dict) and first.get("format") == FORMAT


def header_differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What a results file's header says that this run does not (empty: the same run)."""
    if old.get("version") != new["version"]:
        return [f"results format version {old.get('version')!r}, this plamo2-tools writes {new['version']}"]
    found = [] if old.get("model") == new["model"] else ["another model (its shard files or tokenizer differ)"]
    was = old.get("settings") if isinstance(old.get("settings"), dict) else {}
    for key, option in SETTING_OPTIONS.items():
        if was.get(key) != new["settings"][key]:
            found.append(f"{option} {json.dumps(was.get(key))} there, {json.dumps(new['settings'][key])} now")
    return found


class ResultsFile:
    """`--output`: a results file of this run (module doc), locked while this object is open."""

    def __init__(self, path: str | Path, header: dict[str, Any], command: str = "generate") -> None:
        self.header = header
        self.header_line = (json.dumps(header, sort_keys=True) + "\n").encode()
        self.out = SingleFileOutput(
            Path(path),
            "--output",
            command,
            is_results_file,
            how_to_proceed="move it away or name another --output; plamo2-tools writes only files that start "
            "with its results header",
        )
        self.path = self.out.path
        self.fd: int | None = None
        try:
            self.raw = self.out.read().decode("utf-8", errors="replace").splitlines()  # as found, header first
            self._check_header()
            self.has_header = bool(self.raw)  # False: the header is written with the first record
        except BaseException:
            self.close()
            raise

    def _check_header(self) -> None:
        if len(self.raw) < 2:  # absent, empty, or our header alone: nothing to keep, begin again
            self.raw = []
            return
        old = _first_line(self.raw[0].encode())
        differs = header_differences(old, self.header)
        if differs:
            raise OutputExistsError(
                f"--output {self.path}: holds the results of another run ({'; '.join(differs)}): refused, nothing "
                "was changed (name another --output, or delete the file to start over)"
            )

    def done(self, lines: list[Line]) -> dict[int, dict[str, Any]]:
        """Records that still hold (this line's text, no error): the lines to skip.  The file is
        rewritten without the rest (a cut last line, error records, lines that changed)."""
        wanted = {line.index: line.sha256 for line in lines}
        found: dict[int, dict[str, Any]] = {}
        for text in self.raw[1:]:
            record = _record(text)  # None: a line cut by a kill
            if not isinstance(record, dict) or "error" in record or "choices" not in record:
                continue
            index = record.get("index")
            if isinstance(index, int) and wanted.get(index) == record.get("input_sha256"):
                found[index] = record
        if self.has_header and len(found) != len(self.raw) - 1:
            self.rewrite(sorted(found.values(), key=lambda r: r["index"]))
        return found

    def rewrite(self, records: list[dict[str, Any]]) -> None:
        """The whole file at once (header first), by rename: a kill leaves the old file or the new one."""
        self._close_fd()
        self.out.replace([self.header_line, *(_record_line(r) for r in records)])
        self.has_header = True

    def append(self, record: dict[str, Any]) -> None:
        """One more record, flushed to the file as one write (the header goes first into a new file)."""
        if self.fd is None:
            if not self.has_header:
                self.rewrite([])
            self.fd = self.out.append_fd()
        write_all(self.fd, _record_line(record), self.path)

    def records(self) -> dict[int, dict[str, Any]]:
        """Every record now in the file (this run's appends included), by line index."""
        self._close_fd()
        found: dict[int, dict[str, Any]] = {}
        for text in self.out.read().decode("utf-8", errors="replace").splitlines()[1:]:
            record = _record(text)
            if isinstance(record, dict) and isinstance(record.get("index"), int):
                found[record["index"]] = record
        return found

    def _close_fd(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def close(self) -> None:
        self._close_fd()
        self.out.close()

    def __enter__(self) -> ResultsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _record_line(record: dict[str, Any]) -> bytes:
    return (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")


def error_record(line: Line) -> dict[str, Any]:
    return {"index": line.index, "input_sha256": line.sha256, "error": {"line": line.number, "message": line.error}}


def plan_capacity(lines: list[Line], cap: int) -> int:
    need = [len(p.token_ids) + p.max_tokens for line in lines if line.error is None for p in line.prompts]
    return min(max(need, default=2), cap)


def context_cap(max_context: int | None, positions: int) -> int:
    """Tokens one line may hold (prompt + completion): --max-context, by default serve's 4096, never
    more than the model's positions.  (PLaMo 2 declares at least 10 Mi positions: without a cap, one
    line's max_tokens sized the whole KV cache.)"""
    return min(int(max_context or DEFAULT_MAX_CONTEXT), positions)


def run_batch(
    rt: Runtime,
    input_path: str,
    results: ResultsFile | None,
    defaults: dict[str, Any] | None = None,
    strict: bool = False,
    max_batch: int | str = "auto",
    sync_every: int = 8,
    max_context: int | None = None,
    on_start: Callable[[int, int], None] | None = None,
    on_result: Callable[[dict[str, Any]], None] | None = None,
    on_refused: Callable[[int, str], None] | None = None,
) -> BatchSummary | None:
    """Run every request of the input file through one online loop over `rt` (a job: under
    torchrun the other ranks follow rank 0's loop, pass `results=None` and return None).

    `on_start(lines to run, lines already done)`, `on_result(record)` as each finishes and
    `on_refused(line number, message)` for each line that cannot run are called on rank 0."""
    import time

    start = time.perf_counter()
    src = Path(input_path)
    lines = read_lines(src, Defaults(**(defaults or {})))
    if not lines:
        raise UserError(f"--input {src}: no requests (every line is blank)")
    positions = int(rt.config.max_position_embeddings)
    cap = context_cap(max_context, positions)
    V = int(rt.config.vocab_size)
    tokenize_lines(lines, rt.tokenizer, ModelInfo("batch", V, cap, 1), positions)
    bad = [line for line in lines if line.error is not None]
    if strict and bad:
        first = bad[0]
        more = f" (and {len(bad) - 1} more line(s))" if len(bad) > 1 else ""
        raise UserError(f"--input {src} line {first.number}: {first.error}{more}")
    options = LoopOptions(max_batch=max_batch, max_context=plan_capacity(lines, cap), sync_every=sync_every)
    if not rt.is_main:
        follow(rt, options)
        return None
    assert results is not None, "rank 0 writes the results"
    done = results.done(lines)
    todo = [line for line in lines if line.error is None and line.index not in done]
    for line in bad:
        if on_refused is not None:
            on_refused(line.number, line.error or "")
    if on_start is not None:
        on_start(len(todo), len(done))
    generated = 0
    if todo:
        generated = asyncio.run(_run(rt, options, todo, results, on_result))
    records = {**done, **{line.index: error_record(line) for line in bad}}
    # Every line has its record now: the file in line order (re-reading what this run appended).
    records.update({i: r for i, r in results.records().items() if "choices" in r})
    results.rewrite([records[i] for i in sorted(records)])
    return BatchSummary(
        len(lines),
        len(done),
        len(todo),
        [(b.number, b.error or "") for b in bad],
        generated,
        time.perf_counter() - start,
        str(results.path),
    )


async def _run(
    rt: Runtime,
    options: LoopOptions,
    todo: list[Line],
    results: ResultsFile,
    on_result: Callable[[dict[str, Any]], None] | None,
) -> int:
    engine = RuntimeEngine(rt, "batch", options, log_failures=False)
    generated = 0
    try:
        try:
            await engine.start()
        except (EngineError, UserError):  # UserError: "the online loop is not running" (it died at once)
            # The loop's own failure (say the KV cache for --max-context does not fit in memory)
            # is what the command reports, not the wrapper that says the start failed.
            if engine.loop.error is not None:
                raise engine.loop.error from None
            raise

        async def one(line: Line) -> None:
            nonlocal generated
            record = await _complete(engine, line)
            generated += record["usage"]["completion_tokens"]
            results.append(record)
            if on_result is not None:
                on_result(record)

        await asyncio.gather(*(one(line) for line in todo))
    finally:
        await engine.stop()
    if engine.loop.error is not None:
        raise engine.loop.error
    return generated


async def _complete(engine: RuntimeEngine, line: Line) -> dict[str, Any]:
    """One line's completion object, as /v1/completions answers it (choices in the same order)."""
    req = line.request
    assert req is not None
    sampling = Sampling(
        req.temperature, req.top_p, req.seed, req.stop, req.logprobs, req.logprobs if req.echo else None, req.ignore_eos
    )
    requests = fan_out(f"line{line.index}", line.prompts, req.n, sampling)
    echo = [
        (p.text if p.text is not None else engine.detokenize(p.token_ids)) if req.echo else None for p in line.prompts
    ]
    # token ids are kept for every choice (prompt_token_ids=[] asks for them; the prompt's are not written)
    states = [CompletionChoiceState(i, echo[i // req.n], req.logprobs is not None, []) for i in range(len(requests))]

    async def choice(i: int) -> None:
        async with aclosing(engine.submit(requests[i])) as events:
            async for event in events:
                states[i].delta(event)
                if event.finish_reason is not None:
                    return
        raise EngineError(f"line {line.number}: the sequence ended without a finish reason")

    await asyncio.gather(*(choice(i) for i in range(len(requests))))
    choices = []
    for s in states:
        c = s.choice().model_dump()
        c.pop("prompt_token_ids", None)
        choices.append(c)
    use = usage([len(p.token_ids) for p in line.prompts], [len(s.token_ids) for s in states])
    return {"index": line.index, "input_sha256": line.sha256, "choices": choices, "usage": use.model_dump()}


__all__ = [
    "BatchSummary",
    "Defaults",
    "ResultsFile",
    "TokenEvent",
    "line_seed",
    "parse_line",
    "run_batch",
    "run_header",
]
