"""`python -m bench NAME [options]`: run one benchmark of the suite (bench/__init__.py)."""

from __future__ import annotations

import argparse
import signal
import sys
import traceback

from bench import BENCHMARKS, load
from bench.common import Result, add_common_arguments, add_model_arguments


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    ap.add_argument("--list", action="store_true", help="list the benchmarks and what each measures")
    sub = ap.add_subparsers(dest="benchmark", metavar="NAME")
    for name in BENCHMARKS:
        module = load(name)
        doc = (module.__doc__ or "").strip()
        p = sub.add_parser(
            name,
            help=doc.splitlines()[0] if doc else "",
            description=doc,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        add_common_arguments(p, name)
        if module.MODEL:
            add_model_arguments(p)
        module.add_arguments(p)
    return ap


class Stopped(BaseException):
    """SIGTERM, raised where the benchmark is (not an Exception: no `except Exception` swallows it)."""


def _stopped(signum: int, frame: object) -> None:
    raise Stopped


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = parser()
    args = ap.parse_args(argv)
    if args.list or args.benchmark is None:
        for name in BENCHMARKS:
            print(f"{name:12s} {(load(name).__doc__ or '').strip().splitlines()[0]}")
        return 0
    module = load(args.benchmark)
    result = Result(args.benchmark, module.KIND, args, argv)
    signal.signal(signal.SIGTERM, _stopped)  # the session driver's stop: leave the file saying so
    try:
        module.run(args, result)
    except KeyboardInterrupt:
        result.save(error="interrupted")
        print(f"interrupted: what ran is in {args.out}", file=sys.stderr)
        return 130
    except Stopped:
        result.save(error="stopped (SIGTERM: past its deadline)")
        print(f"stopped: what ran is in {args.out}", file=sys.stderr)
        return 143
    except Exception as e:  # a benchmark's crash keeps the numbers it had, and says why
        traceback.print_exc()
        result.save(error=f"{type(e).__name__}: {e}"[:2000])
        print(f"{args.benchmark} failed: what ran is in {args.out}", file=sys.stderr)
        return 1
    result.save(complete=True)
    print(f"wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
