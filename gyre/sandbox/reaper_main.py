"""The reaper process that :func:`gyre.sandbox.reaper.start_reaper` starts (:mod:`gyre.sandbox.reaper`).

Usage: python -m gyre.sandbox.reaper_main --pid PID --backend NAME --label LABEL [--host URL] [--remove DIR ...]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time

from gyre.sandbox.reaper import process_start_time
from gyre.sandbox.registry import BACKENDS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gyre.sandbox.reaper_main")
    parser.add_argument("--pid", type=int, required=True)
    parser.add_argument("--start-time", default="")
    parser.add_argument("--backend", required=True)
    parser.add_argument("--label", required=True)
    parser.add_argument("--host", default=None)
    parser.add_argument("--remove", action="append", default=[])
    parser.add_argument("--poll-s", type=float, default=0.5)
    args = parser.parse_args(argv)
    start = args.start_time or process_start_time(args.pid)
    while start is not None and process_start_time(args.pid) == start:
        time.sleep(args.poll_s)
    backend = BACKENDS[args.backend](**({"host": args.host} if args.host else {}))
    try:
        backend.sweep(args.label)
    finally:
        backend.close()
        for d in args.remove:
            shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
