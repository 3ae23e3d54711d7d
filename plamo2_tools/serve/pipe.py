"""The pipe between the model's process (`engine_core.EngineCore`, the online loop) and the HTTP
process (`front.ProcessEngine`): length-prefixed frames on one Unix socket pair, each a `marshal`ed
tuple of plain data (str, int, float, bool, None, tuples, lists, dicts).

marshal, not pickle: every message is plain data, so nothing on either side can make the other
run code, and it is the fastest serializer of such values that the standard library has.  Both ends
are processes `serve` started itself on a socket pair nobody else holds.

HTTP process -> model process:

    ("submit", request_fields)          GenerationRequest's fields in declaration order (`request_fields`)
    ("cancel", request_id)
    ("score", job, seqs, starts, top_k)
    ("stop",)                           the HTTP side is done: close the loop (cancelling what runs)

model process -> HTTP process:

    ("ready", model_info, banner)       after the warm-up: ModelInfo's fields as a dict, the start line
    ("events", events, waiting, running)   one drain of the loop: (request_id, token_ids, finished,
                                        finish_reason, stop_reason, error, stamps) per sequence
    ("stats", waiting, running)         the loop's gauges changed (an idle loop reads 0 and 0)
    ("scored", job, scores, error)      scores: per sequence (logprobs, top_ids, top_logprobs)
    ("failed", why)                     the loop died: every request fails, the server stops
    ("stopped",)                        the loop is closed: the last message
"""

from __future__ import annotations

import dataclasses
import marshal
import socket
import threading
from multiprocessing.connection import Connection
from typing import Any

from ..generation_request import GenerationRequest

Message = tuple[Any, ...]
_FIELDS = tuple(f.name for f in dataclasses.fields(GenerationRequest))


def request_fields(request: GenerationRequest) -> tuple[Any, ...]:
    return tuple(getattr(request, name) for name in _FIELDS)


def request_from(fields: Any) -> GenerationRequest:
    values = dict(zip(_FIELDS, fields, strict=True))
    values["prompt_token_ids"] = tuple(values["prompt_token_ids"])
    values["stop"] = tuple(values["stop"])
    return GenerationRequest(**values)


class Pipe:
    """One end of the socket pair.  `send` may be called from any thread (a lock keeps frames
    whole); `recv` from one thread only, and raises EOFError once the other end is gone."""

    def __init__(self, sock: socket.socket) -> None:
        self.conn = Connection(sock.detach())
        self.lock = threading.Lock()

    @classmethod
    def from_fd(cls, fd: int) -> Pipe:
        return cls(socket.socket(fileno=fd))

    def send(self, message: Message) -> None:
        data = marshal.dumps(message, 4)
        with self.lock:
            self.conn.send_bytes(data)

    def recv(self) -> Message:
        return marshal.loads(self.conn.recv_bytes())

    def close(self) -> None:
        self.conn.close()


def pair() -> tuple[socket.socket, socket.socket]:
    """(the model process's end, the HTTP process's end); the second is inherited by the child."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    b.set_inheritable(True)
    return a, b
