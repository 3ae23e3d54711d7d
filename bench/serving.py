"""`plamo2-tools serve` under closed-loop clients and Poisson arrivals, beside in-process generate on the same prompts.

    python -m bench serving [--shards DIR | --preset plamo-2-1b --dtype bfloat16] [--device cuda]
        [--clients 1,64,256] [--per-client 4] [--rates 32,128] [--open-requests 128]
        [--prompt-tokens 256] [--max-tokens 128] [--variant NAME:ENV=VALUE,...] [--trace]
        [--client-procs 8] [--max-seconds 900] [--server-arg=--sync-every=8 ...]

Measures, per level: output tokens/s, time to first token (TTFT) p50/p99 (all requests, and "steady":
every request but each client's first, whose burst arrives at once), the inter-token gap (time per
output token after the first, TPOT) p50/p99, and the server's CPU seconds per output token (every
process of the server; robust where other jobs share the CPU).  The baseline, measured in the same
run on the same prompts: in-process `Runtime.generate(max_batch=N)`, its tokens/s, its decode step
(device time per step at that batch, `PhaseTimer`), its CPU per token, and the Triton compiles and SSD
tunings that happened inside its clock (`kernels/compile_watch.py`: 0 once the warm-up met every shape).

What runs:
* per `--variant` (default one, `serve`; `NAME:ENV=VALUE,...` runs the server with those
  environment variables, e.g. `thread:PLAMO2_SERVE_HTTP_PROCESS=0`), one `serve` subprocess
  (`--max-batch` = the largest N, `--max-context` = the longest request), then per level:
  - closed loop, N of --clients: N clients, each sending --per-client requests one after the other;
  - open loop, R of --rates: --open-requests requests arriving as a Poisson process of R per second
    (seeded), each on its own connection whatever the others do;
  every request streamed (SSE) with `ignore_eos` (every answer has exactly --max-tokens tokens),
  greedy, after a warm-up of the level's own prompts (--max-tokens 4: their prefill shapes compile
  outside the clock);
* in-process, after the servers stopped (one device, one model at a time): the same prompts through
  one `Runtime.generate(max_batch=N)` per closed level, after a warm-up of the same shapes.

Prompts are random token ids (seeded, --seed) of --prompt-tokens ± 25% tokens, BOS first.  Tokens/s =
output tokens / wall time from the first request sent to the last answer's end.  The clients are a
minimal HTTP/1.1 + SSE reader on asyncio streams in --client-procs processes of their own (parsing
thousands of chunks a second must not be what is measured).  `--trace` runs the server with
PLAMO2_SERVE_TRACE and adds each level's per-stage times (serve/trace.py) to its record.

Targets (issue 32; `targets` in the results, rendered by `plamo2-tools report`): server tokens/s ≥ 90%
of in-process at 64 and 256 clients; steady TTFT p50 ≤ 100 ms and p99 ≤ 300 ms at 64 clients; gap
p50 ≤ 1.2 × the in-process decode step at 64 and 256 clients.

--max-seconds (default 900 once the shards are ready) bounds the run: a step that would start past it
is skipped, one that runs past it is cut (its record says `complete: false`).  The file is rewritten
after every step.  Runs on the CPU too (`--preset tiny --device cpu`: the tests do, with small sizes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import re
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import Result, cli, ints, model_inputs, tree_env, work_dir
from plamo2_tools.kinds import BENCH_SERVING_KIND

KIND = BENCH_SERVING_KIND
MODEL = True
DEFAULT_SECONDS = 900.0  # without --max-seconds: the bound once the shards are ready
SERVING = re.compile(r"serving (\S+) on http://([^\s:,]+):(\d+) \((\d+) slots of (\d+) tokens")
TARGET = "server tokens/s >= 90% of in-process at 64 and 256 clients; steady TTFT p50 <= 100 ms, p99 <= 300 ms at 64"
TARGET_RATIO, TARGET_CLIENTS = 0.9, (64, 256)
TARGET_TTFT_P50_S, TARGET_TTFT_P99_S, TARGET_TTFT_CLIENTS = 0.100, 0.300, 64
TARGET_GAP_VS_STEP = 1.2


def make_prompts(count: int, mean: int, vocab: int, bos: int | None, seed: int) -> list[list[int]]:
    rnd = random.Random(seed)
    low, high = max(1, int(mean * 0.75)), max(1, int(mean * 1.25))
    prompts = []
    for _ in range(count):
        n = rnd.randint(low, high)
        ids = [rnd.randrange(4, vocab) for _ in range(n)]
        prompts.append(([bos] + ids[1:]) if bos is not None else ids)
    return prompts


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """'thread:PLAMO2_SERVE_HTTP_PROCESS=0,X=1' -> ('thread', {...}); 'serve' -> ('serve', {})."""
    name, _, rest = text.partition(":")
    env = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise SystemExit(f"--variant {text!r}: expected NAME:ENV=VALUE[,ENV=VALUE]")
        env[key] = value
    if not name:
        raise SystemExit(f"--variant {text!r}: the name is empty")
    return name, env


# ---- the server ---------------------------------------------------------------------------------------
class Server:
    def __init__(
        self, shards: Path, args: argparse.Namespace, slots: int, context: int, env: dict[str, str] | None = None
    ) -> None:
        cmd = cli(
            "serve",
            str(shards),
            "--port",
            "0",
            "--device",
            args.device,
            "--max-batch",
            str(slots),
            "--max-context",
            str(context),
            "--max-queue",
            str(slots),
            *args.server_arg,
        )
        full = tree_env(**(env or {}))
        if args.device == "cpu":  # OpenMP threads spinning beside the client processes slow a CPU run many times
            full.setdefault("OMP_NUM_THREADS", "1")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, env=full, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        self.log: list[str] = []
        self.up = threading.Event()
        self.model, self.host, self.port, self.slots, self.context = "", "", 0, 0, 0
        threading.Thread(target=self._read, daemon=True).start()
        while not self.up.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() - t0 > args.start_timeout:
                self.proc.kill()
                raise SystemExit("serve did not start:\n" + "".join(self.log[-30:]))
        self.startup_s = time.monotonic() - t0

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)
            m = SERVING.search(line)
            if m and not self.up.is_set():
                self.model, self.host, self.port = m.group(1), m.group(2), int(m.group(3))
                self.slots, self.context = int(m.group(4)), int(m.group(5))
                self.up.set()

    def cpu_seconds(self) -> float | None:
        """User + system CPU seconds of the server's processes so far (the model's and its HTTP child)."""
        return tree_cpu_seconds(self.proc.pid)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def tree_cpu_seconds(pid: int) -> float | None:
    """utime + stime of `pid` and its descendants from /proc (None where there is no /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, float]] = {}  # pid -> (parent, cpu seconds)
    try:
        entries = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return None
    for p in entries:
        try:
            text = Path(f"/proc/{p}/stat").read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "
        stats[int(p)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    if pid not in stats:
        return None
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += stats[p][1]
        todo += [c for c, (parent, _) in stats.items() if parent == p]
    return total


# ---- the clients: HTTP/1.1 + SSE on asyncio streams ----------------------------------------------------
async def _body_chunks(reader: asyncio.StreamReader, chunked: bool):  # type: ignore[no-untyped-def]
    if not chunked:
        while data := await reader.read(65536):
            yield data
        return
    while True:
        size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
        if size == 0:
            return
        data = await reader.readexactly(size + 2)
        yield data[:-2]


async def stream_request(host: str, port: int, body: dict[str, Any]) -> dict[str, float]:
    """One streamed completion: start, time of the first token, end (monotonic seconds), tokens."""
    payload = json.dumps(body).encode()
    start = time.monotonic()
    reader, writer = await asyncio.open_connection(host, port)
    try:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n" % host.encode()
        writer.write(head + b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(payload), payload))
        await writer.drain()
        status = (await reader.readline()).split(b" ", 2)
        headers: dict[str, str] = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            k, _, v = line.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip().lower()
        chunked = headers.get("transfer-encoding") == "chunked"
        if len(status) < 2 or status[1] != b"200":
            rest = b"".join([c async for c in _body_chunks(reader, chunked)])
            raise RuntimeError(f"HTTP {status[1:2]}: {rest[:300]!r}")
        first, tokens, buf = 0.0, 0, b""
        async for data in _body_chunks(reader, chunked):
            buf += data
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                if not event.startswith(b"data: ") or event == b"data: [DONE]":
                    continue
                choice = json.loads(event[6:])["choices"][0]
                n = len(choice.get("token_ids") or ())
                if n and not first:
                    first = time.monotonic()
                tokens += n
        return {"start": start, "first": first, "end": time.monotonic(), "tokens": tokens}
    finally:
        writer.close()


def client_process(
    host: str,
    port: int,
    work: list[list[tuple[float | None, dict[str, Any]]]],
    start_at: float,
    deadline: float,
    results: Any,
) -> None:
    """Run these clients from `start_at`.  A client is a list of (offset, body): with offsets None it
    sends its bodies one after the other (closed loop); with offsets each request starts at start_at +
    offset on its own (open loop, one client per request).  Each record says which client and turn."""

    async def one_client(c: int, items: list[tuple[float | None, dict[str, Any]]], out: list[dict[str, float]]) -> None:
        for turn, (offset, body) in enumerate(items):
            if offset is not None:
                await asyncio.sleep(max(0.0, start_at + offset - time.monotonic()))
            out.append({**await stream_request(host, port, body), "client": c, "turn": turn})

    async def main() -> list[dict[str, Any]]:
        await asyncio.sleep(max(0.0, start_at - time.monotonic()))
        out: list[dict[str, float]] = []
        tasks = [asyncio.ensure_future(one_client(c, items, out)) for c, items in enumerate(work)]
        done, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()))
        for t in pending:
            t.cancel()
        errors = [repr(t.exception()) for t in done if t.exception() is not None]
        return [{"cut": bool(pending), "errors": errors[:3]}, *out]

    results.put(asyncio.run(main()))


def run_clients(
    server: Server, clients: list[list[tuple[float | None, dict[str, Any]]]], procs: int, deadline: float
) -> tuple[list[dict[str, float]], bool, list[str], float]:
    """All clients, spread over up to `procs` processes, started together; (records, cut, errors, t0)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    groups = [clients[i::procs] for i in range(min(procs, len(clients)))]
    start_at = time.monotonic() + 1.0 + 0.2 * len(groups)  # time for the processes to start
    ps = [
        ctx.Process(target=client_process, args=(server.host, server.port, g, start_at, deadline, results))
        for g in groups
    ]
    for p in ps:
        p.start()
    records, cut, errors = [], False, []
    for _ in ps:
        head, *recs = results.get(timeout=max(60.0, deadline - time.monotonic() + 60))
        cut |= head["cut"]
        errors += head["errors"]
        records += recs
    for p in ps:
        p.join(30)
    return records, cut, errors, start_at


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    if not records:
        return {"output_tokens": 0, "wall_s": None, "tokens_per_s": None}
    wall = max(r["end"] for r in records) - min(r["start"] for r in records)
    tokens = sum(int(r["tokens"]) for r in records)
    ttft = [r["first"] - r["start"] for r in records if r["first"]]
    steady = [r["first"] - r["start"] for r in records if r["first"] and r.get("turn", 0) > 0]
    tpot = [(r["end"] - r["first"]) / (r["tokens"] - 1) for r in records if r["first"] and r["tokens"] > 1]
    return {
        "output_tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall > 0 else None,
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p99_s": percentile(ttft, 0.99),
        "ttft_steady_p50_s": percentile(steady, 0.5),
        "ttft_steady_p99_s": percentile(steady, 0.99),
        "tpot_p50_s": percentile(tpot, 0.5),
        "tpot_p99_s": percentile(tpot, 0.99),
    }


def bodies(model: str, prompts: list[list[int]], max_tokens: int) -> list[dict[str, Any]]:
    return [
        {
            "model": model,
            "prompt": p,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        for p in prompts
    ]


def closed_clients(work: list[dict[str, Any]], n: int) -> list[list[tuple[float | None, dict[str, Any]]]]:
    return [[(None, b) for b in work[i::n]] for i in range(n)]  # client i sends requests i, i + n, ...


def open_clients(work: list[dict[str, Any]], rate: float, seed: int) -> list[list[tuple[float | None, dict[str, Any]]]]:
    """Poisson arrivals at `rate` per second: exponential gaps, seeded; one client per request."""
    rnd, at, out = random.Random(seed), 0.0, []
    for b in work:
        out.append([(at, b)])
        at += rnd.expovariate(rate)
    return out


# ---- one level on one server ---------------------------------------------------------------------------
def server_level(
    server: Server,
    args: argparse.Namespace,
    level: dict[str, Any],
    prompts: list[list[int]],
    deadline: float,
    trace: Path | None,
) -> dict[str, Any]:
    """One level after a warm-up with its own prompts (4 tokens each; session 4 on the H200 saw TTFT p99
    of 1.5-4.5 s from prefill shapes met for the first time without it)."""
    n = level.get("clients") or min(len(prompts), 64)
    warm = closed_clients(bodies(server.model, prompts, 4), n)  # every prompt of the level, as many at once
    work = bodies(server.model, prompts, args.max_tokens)
    clients = (
        closed_clients(work, level["clients"])
        if level["mode"] == "closed"
        else open_clients(work, level["rate"], args.seed)
    )
    cpu0 = cpu1 = None
    try:
        run_clients(server, warm, args.client_procs, deadline)
        cpu0 = server.cpu_seconds()
        records, cut, errors, t0 = run_clients(server, clients, args.client_procs, deadline)
        cpu1 = server.cpu_seconds()
    except Exception as e:  # a client process died or never answered: record it, go on
        records, cut, errors, t0 = [], True, [f"clients failed: {e!r}"], time.monotonic()
    if server.proc.poll() is not None:
        errors.append(f"the server exited with {server.proc.returncode}: {''.join(server.log[-5:])}")
    rec: dict[str, Any] = {
        **level,
        "per_client": args.per_client if level["mode"] == "closed" else None,
        "requests": len(records),
        "complete": not cut and len(records) == len(prompts),
        "errors": errors,
        **summarize(records),
    }
    cpu = (cpu1 - cpu0) if cpu0 is not None and cpu1 is not None else None
    rec["cpu_s"] = cpu
    rec["cpu_ms_per_token"] = 1e3 * cpu / rec["output_tokens"] if cpu is not None and rec["output_tokens"] else None
    if trace is not None and trace.exists():
        from plamo2_tools.serve.trace import read, stage_summary

        rec["stages"] = stage_summary(r for r in read(trace) if r["stamps"].get("arrival", 0) >= t0)
    what = f"N={level['clients']:4d}" if level["mode"] == "closed" else f"R={level['rate']:g}/s"
    tps, ttft = rec["tokens_per_s"] or 0.0, (rec["ttft_p50_s"] or 0, rec["ttft_p99_s"] or 0)
    note = ("" if rec["complete"] else "  (cut: --max-seconds)") + (f"  errors: {errors[0]}" if errors else "")
    print(
        f"{level['variant']:>8} {what}: {tps:10.1f} tok/s  TTFT p50 {ttft[0]:.3f} s p99 {ttft[1]:.3f} s{note}",
        flush=True,
    )
    return rec


# ---- in-process ---------------------------------------------------------------------------------------
def in_process(
    args: argparse.Namespace,
    shards: Path,
    levels: list[tuple[int, list[list[int]]]],
    walls: dict[int, float],
    deadline: float,
    result: Result,
) -> dict[int, dict[str, Any]]:
    import torch

    from plamo2_tools import Runtime
    from plamo2_tools.kernels import compile_watch
    from plamo2_tools.runtime.batching.generation import PhaseTimer

    out: dict[int, dict[str, Any]] = {}
    if args.device == "cpu":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))  # as the server's process had
    with Runtime(shards, device=args.device, mode="local") as rt:
        for n, prompts in levels:
            left = deadline - time.monotonic()
            if left < 2.5 * walls.get(n, 0.0) + 5:  # the warm-up and the timed run, with room
                result.skip(f"in-process at {n} clients")
                continue
            rt.generate(prompts[:n], 8, max_batch=n)  # warm-up: this batch's shapes (and graphs)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            timer = rt.engines[0].timer = PhaseTimer()
            counts0 = dict(compile_watch.counts)  # Triton's cache misses and SSD tunings inside the clock (GPU)
            cpu0, t0 = time.process_time(), time.monotonic()
            gen = rt.generate(prompts, args.max_tokens, max_batch=n)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
            rt.engines[0].timer = None
            tokens = sum(len(t) for t in gen.tokens)
            steps = timer.counts["decode_steps"]
            step = timer.seconds()["decode"] / steps if steps else None
            out[n] = {
                "tokens_per_s": tokens / wall,
                "wall_s": wall,
                "output_tokens": tokens,
                "step_s": step,
                "cpu_s": cpu,
                "cpu_ms_per_token": 1e3 * cpu / tokens if tokens else None,
                "compiles_timed": compile_watch.counts["compiles"] - counts0["compiles"],
                "tunings_timed": compile_watch.counts["tunings"] - counts0["tunings"],
            }
            ms = f"{1e3 * step:.2f} ms/step" if step else "?"
            compiled = out[n]["compiles_timed"] + out[n]["tunings_timed"]
            ms += f", {compiled} compiles/tunings in the timed run" if compiled else ""
            print(
                f"in-process N={n:4d}: {tokens / wall:10.1f} tok/s ({tokens} tokens in {wall:.2f} s, {ms})", flush=True
            )
    return out


# ---- the targets --------------------------------------------------------------------------------------
def targets(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each target of the issue, per variant, at the levels it names: value, limit, met."""
    out = []
    for r in runs:
        if r.get("skipped") or r.get("mode") != "closed":
            continue
        n, v = r["clients"], r["variant"]
        if n in TARGET_CLIENTS and r.get("ratio") is not None:
            out.append(
                {
                    "check": "tokens/s vs in-process",
                    "variant": v,
                    "clients": n,
                    "value": r["ratio"],
                    "limit": f">= {TARGET_RATIO}",
                    "ok": r["ratio"] >= TARGET_RATIO,
                }
            )
        if n == TARGET_TTFT_CLIENTS:
            for key, limit in (("ttft_steady_p50_s", TARGET_TTFT_P50_S), ("ttft_steady_p99_s", TARGET_TTFT_P99_S)):
                if r.get(key) is not None:
                    out.append(
                        {
                            "check": key,
                            "variant": v,
                            "clients": n,
                            "value": r[key],
                            "limit": f"<= {limit}",
                            "ok": r[key] <= limit,
                        }
                    )
        if n in TARGET_CLIENTS and r.get("gap_vs_step") is not None:
            out.append(
                {
                    "check": "gap p50 / in-process step",
                    "variant": v,
                    "clients": n,
                    "value": r["gap_vs_step"],
                    "limit": f"<= {TARGET_GAP_VS_STEP}",
                    "ok": r["gap_vs_step"] <= TARGET_GAP_VS_STEP,
                }
            )
    return out


def levels_of(
    variant: str, closed: dict[int, list[list[int]]], opened: dict[float, list[list[int]]]
) -> list[tuple[dict[str, Any], list[list[int]]]]:
    """(level, its prompts): the closed-loop levels, then the open-loop ones."""
    out = [({"variant": variant, "mode": "closed", "clients": n, "rate": None}, ps) for n, ps in closed.items()]
    return out + [({"variant": variant, "mode": "open", "clients": None, "rate": r}, ps) for r, ps in opened.items()]


# ---- the run --------------------------------------------------------------------------------------------
def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--clients", default="1,16,64,256", help="closed-loop concurrency levels ('' for none)")
    ap.add_argument("--per-client", type=int, default=4, help="requests each closed-loop client sends, one by one")
    ap.add_argument("--rates", default="", help="open-loop levels: Poisson arrivals per second (e.g. 32,128)")
    ap.add_argument("--open-requests", type=int, default=128, help="requests of each open-loop level")
    ap.add_argument("--prompt-tokens", type=int, default=256, help="mean prompt length (+-25%%)")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens of every answer (ignore_eos)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--client-procs", type=int, default=min(8, os.cpu_count() or 1))
    ap.add_argument("--start-timeout", type=float, default=600.0, help="seconds the server may take to start")
    ap.add_argument("--server-arg", action="append", default=[], help="an extra `serve` argument (repeat)")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        help="NAME:ENV=VALUE,... a server variant (repeat; default: one, 'serve', as it is)",
    )
    ap.add_argument("--no-in-process", action="store_true", help="skip the in-process baseline")
    ap.add_argument("--trace", action="store_true", help="per-stage times of every request (PLAMO2_SERVE_TRACE)")


def run(args: argparse.Namespace, result: Result) -> None:
    closed_n, rates = ints(args.clients), [float(x) for x in args.rates.split(",") if x.strip()]
    variants = [parse_variant(v) for v in args.variant] or [("serve", {})]
    with work_dir(args) as work:
        _, shards = model_inputs(args, work, result)
        deadline = result.deadline or time.monotonic() + DEFAULT_SECONDS
        cfg = json.loads((shards / "config.json").read_text())
        vocab, bos = int(cfg["vocab_size"]), cfg.get("bos_token_id")
        closed = {n: make_prompts(n * args.per_client, args.prompt_tokens, vocab, bos, args.seed + n) for n in closed_n}
        opened = {r: make_prompts(args.open_requests, args.prompt_tokens, vocab, bos, args.seed + 7919) for r in rates}
        longest = max(len(p) for ps in [*closed.values(), *opened.values()] for p in ps) + args.max_tokens
        slots = max([*closed_n, 1])
        res = result.results
        res.update(
            shards=str(shards),
            device=args.device,
            target=TARGET,
            runs=[],
            servers={},
            config={
                "clients": closed_n,
                "per_client": args.per_client,
                "rates": rates,
                "open_requests": args.open_requests,
                "prompt_tokens": args.prompt_tokens,
                "max_tokens": args.max_tokens,
                "seed": args.seed,
                "client_procs": args.client_procs,
                "server_args": args.server_arg,
                "variants": {name: env for name, env in variants},
            },
        )
        walls: dict[int, float] = {}
        for name, env in variants:
            trace = work / f"trace-{name}.jsonl" if args.trace else None
            extra = {**env, **({"PLAMO2_SERVE_TRACE": str(trace)} if trace else {})}
            if time.monotonic() > deadline - 30:
                result.skip(f"server variant {name}")
                continue
            server = Server(shards, args, slots, longest, extra)
            res["servers"][name] = {"slots": server.slots, "context": server.context, "startup_s": server.startup_s}
            res.setdefault("server", res["servers"][name])  # the first variant's, where older readers look
            print(
                f"serve ({name}): up in {server.startup_s:.1f} s, {server.slots} slots of {server.context} tokens",
                flush=True,
            )
            try:
                for level, prompts in levels_of(name, closed, opened):
                    if server.proc.poll() is not None or time.monotonic() > deadline - 5:
                        result.skip(f"{name} at {level['clients'] or level['rate']}")
                        res["runs"].append({**level, "skipped": True})
                        continue
                    rec = server_level(server, args, level, prompts, deadline, trace)
                    if level["mode"] == "closed":
                        walls[level["clients"]] = max(walls.get(level["clients"], 0.0), rec["wall_s"] or 0.0)
                    res["runs"].append(rec)
                    result.save()
            finally:
                res["servers"][name]["exit_code"] = server.stop()
        local = {}
        if not args.no_in_process:
            local = in_process(args, shards, [(n, closed[n]) for n in closed_n if n in walls], walls, deadline, result)
        res["in_process"] = {str(n): v for n, v in local.items()}
        for rec in res["runs"]:
            ip = local.get(rec.get("clients")) if rec.get("mode") == "closed" and not rec.get("skipped") else None
            rec["in_process"] = ip
            rec["ratio"] = (rec["tokens_per_s"] / ip["tokens_per_s"]) if ip and rec.get("tokens_per_s") else None
            step = ip.get("step_s") if ip else None
            rec["gap_vs_step"] = rec["tpot_p50_s"] / step if step and rec.get("tpot_p50_s") else None
        res["targets"] = targets(res["runs"])
        result.save()
