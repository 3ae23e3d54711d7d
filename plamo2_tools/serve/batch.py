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

Results are appended as requests finish, one JSON line each, flushed.  Re-running with the same
--output resumes: lines whose record is there (for the same input line) are skipped, a cut last
line (a kill in mid-write) is dropped, error records are retried.  Once every line is done the
file is rewritten in line order (atomically), so a resumed run leaves the same file as a clean
one.  A line that cannot run (bad JSON, a wrong field, a prompt beyond the context, ...) is
reported with its line number and gets an error record; the others still run (`strict`: refused
up front instead).
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

from ..errors import UserError, os_error
from ..runtime.serving.engine import Runtime
from .engine_api import EngineError, ModelInfo, TokenEvent
from .prompts import Prompt, Sampling, check_token_ids, fan_out, resolve_max_tokens
from .protocol import ApiError, CompletionRequest, validation_message
from .responses import CompletionChoiceState, usage
from .runtime_engine import LoopOptions, RuntimeEngine
from .service import follow

SEED_MASK = 2**63 - 1


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


def tokenize_lines(lines: list[Line], tokenizer: Any, info: ModelInfo) -> None:
    """Prompts to token ids (text gets BOS as the tokenizer config says, like the server's), checked
    against the vocabulary and the model's positions."""
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
                prompts.append(Prompt(ids, p if isinstance(p, str) else None,
                                      resolve_max_tokens(len(ids), line.request.max_tokens, info)))  # fmt: skip
            if line.request.logprobs is not None and line.request.logprobs > info.max_logprobs:
                raise ApiError(400, f"logprobs must be at most {info.max_logprobs}")
            line.prompts = prompts
        except ApiError as e:
            line.error = e.message


def read_done(path: Path, lines: list[Line]) -> dict[int, dict[str, Any]]:
    """Records of --output that still hold (same input line, no error): the lines to skip.
    The file is rewritten without the rest (a cut last line, error records, stale lines)."""
    if not path.exists():
        return {}
    wanted = {line.index: line.sha256 for line in lines}
    done: dict[int, dict[str, Any]] = {}
    try:
        raw = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError as e:
        raise os_error(e, f"--output {path}: cannot read") from None
    for text in raw:
        try:
            record = json.loads(text)
        except json.JSONDecodeError:
            continue  # a line cut by a kill
        if not isinstance(record, dict) or "error" in record or "choices" not in record:
            continue
        index = record.get("index")
        if isinstance(index, int) and wanted.get(index) == record.get("input_sha256"):
            done[index] = record
    if len(done) != len(raw):
        write_records(path, sorted(done.values(), key=lambda r: r["index"]))
    return done


def write_records(path: Path, records: list[dict[str, Any]]) -> None:
    """The whole file at once, by rename: a kill leaves the old file or the new one."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise os_error(e, f"--output {path}: cannot write") from None


def error_record(line: Line) -> dict[str, Any]:
    return {"index": line.index, "input_sha256": line.sha256, "error": {"line": line.number, "message": line.error}}


def plan_capacity(lines: list[Line], positions: int) -> int:
    need = [len(p.token_ids) + p.max_tokens for line in lines if line.error is None for p in line.prompts]
    return min(max(need, default=2), positions)


def run_batch(
    rt: Runtime,
    input_path: str,
    output_path: str,
    defaults: dict[str, Any] | None = None,
    strict: bool = False,
    max_batch: int | str = "auto",
    sync_every: int = 8,
    on_start: Callable[[int, int], None] | None = None,
    on_result: Callable[[dict[str, Any]], None] | None = None,
    on_refused: Callable[[int, str], None] | None = None,
) -> BatchSummary | None:
    """Run every request of the input file through one online loop over `rt` (a job: under
    torchrun the other ranks follow rank 0's loop and return None).

    `on_start(lines to run, lines already done)`, `on_result(record)` as each finishes and
    `on_refused(line number, message)` for each line that cannot run are called on rank 0."""
    import time

    start = time.perf_counter()
    src, out = Path(input_path), Path(output_path)
    lines = read_lines(src, Defaults(**(defaults or {})))
    if not lines:
        raise UserError(f"--input {src}: no requests (every line is blank)")
    positions = int(rt.config.max_position_embeddings)
    V = int(rt.config.vocab_size)
    tokenize_lines(lines, rt.tokenizer, ModelInfo("batch", V, positions, 1))
    bad = [line for line in lines if line.error is not None]
    if strict and bad:
        first = bad[0]
        more = f" (and {len(bad) - 1} more line(s))" if len(bad) > 1 else ""
        raise UserError(f"--input {src} line {first.number}: {first.error}{more}")
    options = LoopOptions(max_batch=max_batch, max_context=plan_capacity(lines, positions), sync_every=sync_every)
    if not rt.is_main:
        follow(rt, options)
        return None
    done = read_done(out, lines)
    todo = [line for line in lines if line.error is None and line.index not in done]
    for line in bad:
        if on_refused is not None:
            on_refused(line.number, line.error or "")
    if on_start is not None:
        on_start(len(todo), len(done))
    generated = 0
    if todo:
        generated = asyncio.run(_run(rt, options, todo, out, on_result))
    records = {**done, **{line.index: error_record(line) for line in bad}}
    # Every line has its record now: the file in line order (re-reading what this run appended).
    finished = read_done(out, lines) if out.exists() else {}
    records.update(finished)
    write_records(out, [records[i] for i in sorted(records)])
    return BatchSummary(len(lines), len(done), len(todo), [(b.number, b.error or "") for b in bad], generated,
                        time.perf_counter() - start, str(out))  # fmt: skip


async def _run(rt: Runtime, options: LoopOptions, todo: list[Line], out: Path,
               on_result: Callable[[dict[str, Any]], None] | None) -> int:  # fmt: skip
    engine = RuntimeEngine(rt, "batch", options)
    await engine.start()
    generated = 0
    try:
        with open(out, "a", encoding="utf-8") as f:

            async def one(line: Line) -> None:
                nonlocal generated
                record = await _complete(engine, line)
                generated += record["usage"]["completion_tokens"]
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
                f.flush()
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
    sampling = Sampling(req.temperature, req.top_p, req.seed, req.stop, req.logprobs,
                        req.logprobs if req.echo else None, req.ignore_eos)  # fmt: skip
    requests = fan_out(f"line{line.index}", line.prompts, req.n, sampling)
    echo = [(p.text if p.text is not None else engine.detokenize(p.token_ids)) if req.echo else None
            for p in line.prompts]  # fmt: skip
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


__all__ = ["BatchSummary", "Defaults", "TokenEvent", "line_seed", "parse_line", "run_batch"]
