"""`plamo2-tools serve` under N streaming clients against in-process `Runtime.generate` on the same requests.

    python -m bench serving [--shards DIR | --preset plamo-2-1b --dtype bfloat16] [--device cuda]
        [--clients 1,16,64,256] [--per-client 2] [--prompt-tokens 256] [--max-tokens 128]
        [--max-seconds 900] [--client-procs 8] [--server-arg=--sync-every=8 ...]

Measures output tokens/s, time to first token (p50/p99) and time per output token of the server;
the baseline, measured in the same run, is the runtime itself on the same prompts in-process.

What runs, per level N of --clients:
* the server (one subprocess for all levels, `--max-batch` = the largest N, `--max-context` =
  the longest request): N closed-loop clients, each sending --per-client requests one after the
  other, every one streamed (SSE) with `ignore_eos` so that every answer has exactly --max-tokens
  tokens (a random model would stop anywhere), greedy; a warm-up of the level's first N prompts
  (4 tokens each: the prefill shapes compile outside the clock) first;
* in-process: the same N x per-client prompts through one `Runtime.generate(max_batch=N)` call
  after the server has stopped (one device, one model at a time), after a warm-up of the same
  shape; no EOS ids, so the same token counts.

Prompts are random token ids (seeded, --seed) of --prompt-tokens +- 25% tokens, BOS first; the same
for both sides.  Tokens/s = output tokens / wall time from the first request sent to the last
answer's end.  TTFT is from sending the request to the first chunk with a token; TPOT is the rest
of the answer's time over its other tokens.  The clients are a minimal HTTP/1.1 + SSE reader on
asyncio streams spread over --client-procs processes, so that parsing thousands of chunks a second
is not what is measured (and nothing beyond the standard library is needed on the client side).

--max-seconds (default: 900 once the shards are ready) bounds the run: a level that would start past it is
skipped, a level that runs past it is cut (its record says `complete: false`), and the in-process
side of a level runs only while there is time for it.  The file is rewritten after each level.
Runs on the CPU too (`--preset tiny --device cpu`: the tests do, with small sizes).
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

# results: runs[] of {clients, requests, per_client, complete, output_tokens, wall_s, tokens_per_s,
# ttft_p50_s, ttft_p99_s, tpot_p50_s, tpot_p99_s, in_process: {tokens_per_s, wall_s} | null,
# ratio (server / in-process tokens/s) | null}; server: {slots, context, startup_s, exit_code}; config.
KIND = BENCH_SERVING_KIND
MODEL = True
DEFAULT_SECONDS = 900.0  # without --max-seconds: the bound once the shards are ready
SERVING = re.compile(r"serving (\S+) on http://([^\s:,]+):(\d+) \((\d+) slots of (\d+) tokens")
TARGET = "server tokens/s >= 90% of in-process at 64 and 256 clients"


def make_prompts(count: int, mean: int, vocab: int, bos: int | None, seed: int) -> list[list[int]]:
    rnd = random.Random(seed)
    low, high = max(1, int(mean * 0.75)), max(1, int(mean * 1.25))
    prompts = []
    for _ in range(count):
        n = rnd.randint(low, high)
        ids = [rnd.randrange(4, vocab) for _ in range(n)]
        prompts.append(([bos] + ids[1:]) if bos is not None else ids)
    return prompts


# ---- the server ---------------------------------------------------------------------------------------
class Server:
    def __init__(self, shards: Path, args: argparse.Namespace, slots: int, context: int) -> None:
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
        env = tree_env()
        if args.device == "cpu":  # OpenMP threads spinning beside the client processes slow a CPU run many times
            env.setdefault("OMP_NUM_THREADS", "1")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
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

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


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
    host: str, port: int, work: list[list[dict[str, Any]]], start_at: float, deadline: float, results: Any
) -> None:
    """Run these clients (each a list of requests sent one after the other) from `start_at`."""

    async def one_client(bodies: list[dict[str, Any]], out: list[dict[str, float]]) -> None:
        for body in bodies:
            out.append(await stream_request(host, port, body))

    async def main() -> list[dict[str, float]]:
        await asyncio.sleep(max(0.0, start_at - time.monotonic()))
        out: list[dict[str, float]] = []
        tasks = [asyncio.ensure_future(one_client(b, out)) for b in work]
        done, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()))
        for t in pending:
            t.cancel()
        errors = [repr(t.exception()) for t in done if t.exception() is not None]
        return [{"cut": bool(pending), "errors": errors[:3]}, *out]  # type: ignore[list-item]

    results.put(asyncio.run(main()))


def run_clients(
    server: Server, per_client: list[list[dict[str, Any]]], procs: int, deadline: float
) -> tuple[list[dict[str, float]], bool, list[str]]:
    """All clients, spread over up to `procs` processes, started together."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    groups = [per_client[i::procs] for i in range(min(procs, len(per_client)))]
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
    return records, cut, errors


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def summarize(records: list[dict[str, float]]) -> dict[str, Any]:
    if not records:
        return {"output_tokens": 0, "wall_s": None, "tokens_per_s": None}
    wall = max(r["end"] for r in records) - min(r["start"] for r in records)
    tokens = sum(int(r["tokens"]) for r in records)
    ttft = [r["first"] - r["start"] for r in records if r["first"]]
    tpot = [(r["end"] - r["first"]) / (r["tokens"] - 1) for r in records if r["first"] and r["tokens"] > 1]
    return {
        "output_tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall > 0 else None,
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p99_s": percentile(ttft, 0.99),
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


# ---- in-process ---------------------------------------------------------------------------------------
def in_process(
    args: argparse.Namespace,
    shards: Path,
    levels: list[tuple[int, list[list[int]]]],
    server_walls: dict[int, float],
    deadline: float,
    result: Result,
) -> dict[int, dict[str, Any]]:
    import torch

    from plamo2_tools import Runtime

    out: dict[int, dict[str, Any]] = {}
    if args.device == "cpu":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))  # as the server's process had
    with Runtime(shards, device=args.device, mode="local") as rt:
        for n, prompts in levels:
            left = deadline - time.monotonic()
            if left < 2.5 * server_walls.get(n, 0.0) + 5:  # the warm-up and the timed run, with room
                result.skip(f"in-process at {n} clients")
                continue
            rt.generate(prompts[:n], 8, max_batch=n)  # warm-up: this batch's shapes (and graphs)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.monotonic()
            gen = rt.generate(prompts, args.max_tokens, max_batch=n)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            wall = time.monotonic() - t0
            tokens = sum(len(t) for t in gen.tokens)
            out[n] = {"tokens_per_s": tokens / wall, "wall_s": wall, "output_tokens": tokens}
            print(f"in-process N={n:4d}: {tokens / wall:10.1f} tok/s ({tokens} tokens in {wall:.2f} s)", flush=True)
    return out


# ---- the run --------------------------------------------------------------------------------------------
def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--clients", default="1,16,64,256", help="concurrency levels")
    ap.add_argument("--per-client", type=int, default=2, help="requests each client sends, one after the other")
    ap.add_argument("--prompt-tokens", type=int, default=256, help="mean prompt length (+-25%%)")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens of every answer (ignore_eos)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--client-procs", type=int, default=min(8, os.cpu_count() or 1))
    ap.add_argument("--start-timeout", type=float, default=600.0, help="seconds the server may take to start")
    ap.add_argument("--server-arg", action="append", default=[], help="an extra `serve` argument (repeat)")


def run(args: argparse.Namespace, result: Result) -> None:
    levels_n = ints(args.clients)
    with work_dir(args) as work:
        _, shards = model_inputs(args, work, result)
        deadline = result.deadline or time.monotonic() + DEFAULT_SECONDS
        cfg = json.loads((shards / "config.json").read_text())
        vocab, bos = int(cfg["vocab_size"]), cfg.get("bos_token_id")
        levels = [
            (n, make_prompts(n * args.per_client, args.prompt_tokens, vocab, bos, args.seed + n)) for n in levels_n
        ]
        longest = max(len(p) for _, ps in levels for p in ps) + args.max_tokens
        res = result.results
        res.update(
            shards=str(shards),
            device=args.device,
            target=TARGET,
            config={
                "clients": levels_n,
                "per_client": args.per_client,
                "prompt_tokens": args.prompt_tokens,
                "max_tokens": args.max_tokens,
                "seed": args.seed,
                "client_procs": args.client_procs,
                "server_args": args.server_arg,
            },
            runs=[],
        )
        server = Server(shards, args, max(levels_n), longest)
        res["server"] = {"slots": server.slots, "context": server.context, "startup_s": server.startup_s}
        print(f"serve: up in {server.startup_s:.1f} s, {server.slots} slots of {server.context} tokens", flush=True)
        walls: dict[int, float] = {}
        try:
            for n, prompts in levels:
                if server.proc.poll() is not None or time.monotonic() > deadline - 5:
                    result.skip(f"server at {n} clients")
                    res["runs"].append({"clients": n, "skipped": True})
                    continue
                rec = server_level(server, args, n, prompts, deadline)
                walls[n] = rec["wall_s"] or 0.0
                res["runs"].append(rec)
                result.save()
        finally:
            res["server"]["exit_code"] = server.stop()
        local = in_process(args, shards, [(n, ps) for n, ps in levels if n in walls], walls, deadline, result)
        for rec in res["runs"]:
            ip = local.get(rec["clients"]) if not rec.get("skipped") else None
            rec["in_process"] = ip
            rec["ratio"] = (rec["tokens_per_s"] / ip["tokens_per_s"]) if ip and rec.get("tokens_per_s") else None
        result.save()


def server_level(
    server: Server, args: argparse.Namespace, n: int, prompts: list[list[int]], deadline: float
) -> dict[str, Any]:
    """N closed-loop clients, after a warm-up with this level's own prompt shapes (a new prefill shape
    compiles and picks its SSD variant once: session 4 on the H200 saw TTFT p99 of 1.5-4.5 s without it)."""
    warm = [[b] for b in bodies(server.model, prompts[:n], 4)]
    work = bodies(server.model, prompts, args.max_tokens)
    per_client = [work[i::n] for i in range(n)]  # client i sends requests i, i + n, ...
    try:
        run_clients(server, warm, args.client_procs, deadline)
        records, cut, errors = run_clients(server, per_client, args.client_procs, deadline)
    except Exception as e:  # a client process died or never answered: record it, go on
        records, cut, errors = [], True, [f"clients failed: {e!r}"]
    if server.proc.poll() is not None:
        errors.append(f"the server exited with {server.proc.returncode}: {''.join(server.log[-5:])}")
    rec = {
        "clients": n,
        "per_client": args.per_client,
        "requests": len(records),
        "complete": not cut and len(records) == len(prompts),
        "errors": errors,
        **summarize(records),
    }
    tps, ttft = rec["tokens_per_s"] or 0.0, (rec["ttft_p50_s"] or 0, rec["ttft_p99_s"] or 0)
    note = ("" if rec["complete"] else "  (cut: --max-seconds)") + (f"  errors: {errors[0]}" if errors else "")
    print(f"server     N={n:4d}: {tps:10.1f} tok/s  TTFT p50 {ttft[0]:.3f} s p99 {ttft[1]:.3f} s{note}", flush=True)
    return rec
