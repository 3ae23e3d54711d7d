"""A scripted online session (imported by name by the online tests, and by torchrun workers as the
job `online_script:scripted_session`, with this folder on PYTHONPATH).

A script is a list of steps, each a dict:
  {"id", "prompt", "max_tokens", "temperature", "top_p", "seed", "stream", "stop"} submits a request,
  {"cancel": id} cancels one;
  either may carry "after": [id, n]: done from the loop's own event callback once request `id` has
  n tokens (or has finished), so arrivals land at fixed points of the loop, mid-run; "sleep": s
  instead does it from another thread s seconds after the start (arrival time not fixed at all).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from plamo2_tools.generation_request import GenerationRequest
from plamo2_tools.runtime.batching.online import Event, OnlineLoop

REQUEST_KEYS = ("temperature", "top_p", "seed", "stream", "stop", "prompt_logprobs")


def request_of(step: dict[str, Any]) -> GenerationRequest:
    extra = {k: (tuple(step[k]) if k == "stop" else step[k]) for k in REQUEST_KEYS if k in step}
    return GenerationRequest(step["id"], tuple(step["prompt"]), int(step["max_tokens"]), **extra)


def scripted_session(
    rt: Any,
    script: list[dict[str, Any]],
    max_batch: int,
    max_context: int,
    sync_every: int = 8,
    eos: list[int] | None = None,
    timeout: float = 120.0,
) -> dict[str, Any] | None:
    """Run the script on an online loop over `rt`; rank 0 returns, per request id, its tokens,
    finish reason and stop reason (and the loop's stats); other ranks return None."""
    loop = OnlineLoop(
        rt,
        max_batch=max_batch,
        max_context=max_context,
        sync_every=sync_every,
        eos_token_ids=eos if eos is not None else [],
    )
    loop.start()
    if not rt.is_main:
        loop.join()
        return None
    handles: dict[str, Any] = {}
    lock = threading.Lock()
    pending = [s for s in script if "after" in s]
    expected = {s["id"] for s in script if "id" in s}
    all_submitted = threading.Event()

    def act(step: dict[str, Any]) -> None:
        if "cancel" in step:
            loop.cancel(step["cancel"])
        else:
            h = loop.submit(request_of(step), on_event=watch)
            with lock:
                handles[step["id"]] = h
                if set(handles) == expected:
                    all_submitted.set()

    seen: dict[str, int] = {}

    def watch(event: Event) -> None:  # on the loop's thread
        with lock:
            seen[event.request_id] = seen.get(event.request_id, 0) + len(event.token_ids)
            fire = []
            for step in list(pending):
                who, n = step["after"]
                if who == event.request_id and (seen[who] >= n or event.finished):
                    pending.remove(step)
                    fire.append(step)
        for step in fire:
            act(step)

    timers = []
    for step in script:
        if "after" in step:
            continue
        if "sleep" in step:
            t = threading.Timer(step["sleep"], act, args=(step,))
            timers.append(t)
            t.start()
        else:
            act(step)
    if not all_submitted.wait(timeout):
        raise TimeoutError(f"not every request was submitted: {sorted(expected - set(handles))}")
    out: dict[str, Any] = {}
    deadline = time.monotonic() + timeout
    for rid, h in handles.items():
        final = h.result(max(0.1, deadline - time.monotonic()))
        out[rid] = {
            "tokens": list(h.tokens),
            "reason": final.finish_reason,
            "stop_reason": final.stop_reason,
            "error": final.error,
        }
    for t in timers:
        t.join()
    loop.close(cancel=False, timeout=timeout)
    out["_stats"] = loop.loop_stats.summary()
    return out
