"""SIGINT and SIGTERM handled by one function while a block runs, the previous handlers put back
after (the server's HTTP rank drains on them; the torchrun ranks that follow ignore them and stop
when rank 0 closes the loop).  Only the main thread can install handlers: elsewhere (tests run
servers in threads) the block runs with the process's handlers as they are."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

Handler = Callable[[int, FrameType | None], Any] | int


@contextmanager
def stop_signals_handled(handler: Handler) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)
