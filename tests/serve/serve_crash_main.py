"""`plamo2-tools serve ...` with the runtime's decode step broken from its Nth call on (argv[1]),
for test_real_crash.py: a real server whose generation loop dies mid-request."""

from __future__ import annotations

import sys

from plamo2_tools.runtime.batching import graphs

FAIL_FROM = int(sys.argv.pop(1))
calls = [0]
real = graphs.DecodeRunner.step


def broken(self, *args, **kwargs):  # type: ignore[no-untyped-def]
    calls[0] += 1
    if calls[0] >= FAIL_FROM:
        raise RuntimeError("injected: the device fell over")
    return real(self, *args, **kwargs)


graphs.DecodeRunner.step = broken  # type: ignore[method-assign]

if __name__ == "__main__":
    from plamo2_tools.cli import app

    app(prog_name="plamo2-tools")
