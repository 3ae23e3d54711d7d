"""A server process for test_shutdown.py: the fake engine behind `serve_forever` on a free port.

Prints {"port": N} once listening, then, after serve_forever returns, what the engine saw
({"rc", "stopped", "cancelled"}), and exits with serve_forever's return value.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

from serve_fake_engine import FakeEngine

from plamo2_tools.serve import create_app, serve_forever
from plamo2_tools.serve.server import bind_socket


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--delay", type=float, default=0.05)
    ap.add_argument("--shutdown-timeout", type=float, default=10.0)
    args = ap.parse_args()
    engine = FakeEngine(delay=args.delay, max_context=1024)
    app = create_app(engine)
    sock = bind_socket("127.0.0.1", 0)

    def announce() -> None:  # after start-up, so the test connects to a ready server
        while not engine.started:
            time.sleep(0.01)
        print(json.dumps({"port": sock.getsockname()[1]}), flush=True)

    threading.Thread(target=announce, daemon=True).start()
    rc = serve_forever(app, sock=sock, shutdown_timeout=args.shutdown_timeout, log_level="warning")
    print(json.dumps({"rc": rc, "stopped": engine.stopped, "cancelled": engine.cancelled}), flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
