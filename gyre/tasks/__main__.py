"""``python -m gyre.tasks PATH...``: validate task files; one line per problem on stderr.

Exit status: 0 no problem, 1 some tasks were skipped, 2 a path is missing (one line).
"""

from __future__ import annotations

import argparse
import sys

from gyre.tasks.loader import TaskLoadError, load_tasks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gyre.tasks", description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="task files or directories")
    parser.add_argument("--list", action="store_true", help="also print the id and source of each valid task")
    args = parser.parse_args(argv)
    try:
        res = load_tasks(args.paths)
    except TaskLoadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for p in res.problems:
        print(p, file=sys.stderr)
    if args.list:
        for t in res.tasks:
            print(f"{t.id}\t{t.source}")
    print(f"{len(res.tasks)} tasks loaded from {len(res.files)} files, {res.skipped} skipped, "
          f"{len(res.problems)} problems", file=sys.stderr)
    return 1 if res.problems else 0


if __name__ == "__main__":
    sys.exit(main())
