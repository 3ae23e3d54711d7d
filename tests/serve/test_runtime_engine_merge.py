"""`loop_engine.merged`: events of one sequence that piled up while the HTTP thread was busy
go out as one (tokens in order, the last event's end), never past the end of the sequence."""

from __future__ import annotations

import asyncio

from plamo2_tools.runtime.batching.online import Event
from plamo2_tools.serve.loop_engine import merged


def test_waiting_events_are_merged_up_to_the_end() -> None:
    async def run() -> tuple[Event, Event, int]:
        q: asyncio.Queue[Event] = asyncio.Queue()
        for e in (Event("r", (2, 3)), Event("r", (4,), True, "stop", 4), Event("r", (9,))):
            q.put_nowait(e)
        one = merged(Event("r", (1,), prompt_logprobs=None), q)
        return one, merged(q.get_nowait(), q), q.qsize()

    one, rest, left = asyncio.run(run())
    assert one == Event("r", (1, 2, 3, 4), True, "stop", 4)  # stops at the finished event
    assert rest == Event("r", (9,)) and left == 0


def test_a_finished_or_failed_event_is_not_merged_further() -> None:
    async def run() -> tuple[Event, Event]:
        q: asyncio.Queue[Event] = asyncio.Queue()
        q.put_nowait(Event("r", (5,)))
        return merged(Event("r", (1,), True, "length"), q), merged(Event("r", (), error="boom"), q)

    done, failed = asyncio.run(run())
    assert done == Event("r", (1,), True, "length") and failed.error == "boom"
