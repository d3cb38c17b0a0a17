#!/usr/bin/env python
"""Plot a Gyre run: ``python tools/plot_run.py RUN_DIR`` writes RUN_DIR/timeline.png, reward.png and
training.png (loss, grad norm, clip fraction per step).

Exit 0 and the written paths on stdout; exit 2 with one line when RUN_DIR is not a run directory.
"""

import argparse
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="plot_run", description=__doc__.splitlines()[0])
    p.add_argument("run_dir")
    a = p.parse_args(argv)
    from gyre.runtime.plot import plot_run

    try:
        paths = plot_run(a.run_dir)
    except FileNotFoundError as exc:
        print(f"plot_run: error: {exc}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
