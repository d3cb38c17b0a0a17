#!/usr/bin/env python
"""Replay a recorded harness request log through the proxy's normalisation, restoration and
tree building (trace format: tests/data/traces/README.md).

Usage::

    python tools/replay_trace.py TRACE.jsonl [TRACE2.jsonl ...] [--json] [--tokenizer local|qwen|DIR]
                                 [--save-dir DIR]

The engine is teacher-forced: it emits each logged reply rendered in the model's format; attempts
that got no reply (injected failures, ``count_tokens``) are skipped. Printed per trace:
``records``, ``leaves``, ``leaves_by_role``, ``mismatches`` (requests that should have extended
a path but did not), ``duplicates`` (delivered records sharing input and output),
``format_mismatches`` and, with ``--json``, per-request match lengths (one JSON object per
trace, one per line). ``--save-dir`` stores the records (``tools/inspect_tree.py`` reads them).

Exit status 0 when every trace has ``mismatches == 0`` and ``duplicates == 0``, 1 otherwise,
2 on bad input (one-line message on stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        sys.stderr.write(f"replay_trace: error: {message}\n")
        sys.exit(2)


def _fail(message: str) -> int:
    sys.stderr.write(f"replay_trace: error: {message}\n")
    return 2


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status."""
    ap = _Parser(prog="replay_trace.py", description="Replay harness request logs through the Gyre proxy core.")
    ap.add_argument("traces", nargs="+", metavar="TRACE.jsonl", help="request logs (the tests/data/traces format)")
    ap.add_argument("--json", action="store_true", help="one JSON object per trace, with per-request details")
    ap.add_argument("--tokenizer", default="local",
                    help="'local' (fast embedded BPE), 'qwen' (full embedded Qwen vocabulary) or a tokenizer directory")
    ap.add_argument("--save-dir", metavar="DIR", help="store the replayed records here (one file per trace)")
    args = ap.parse_args(argv)
    for t in args.traces:
        if not os.path.isfile(t):
            return _fail(f"no such file: {t}")

    from gyre.embedded_model import ensure_tiny_model, load_tokenizer
    from gyre.proxy.render import ChatRenderer
    from gyre.proxy.replay import replay_trace
    from gyre.trajectory.store import TrajectoryStore

    tok_dir = ensure_tiny_model(args.tokenizer) if args.tokenizer in ("local", "qwen") else args.tokenizer
    if not os.path.isdir(tok_dir):
        return _fail(f"tokenizer directory not found: {tok_dir}")
    try:
        renderer = ChatRenderer(load_tokenizer(tok_dir))
    except (OSError, ValueError) as exc:
        return _fail(f"cannot load tokenizer from {tok_dir}: {exc}")
    store = TrajectoryStore(args.save_dir) if args.save_dir else None
    bad = False
    try:
        for path in args.traces:
            try:
                res = replay_trace(path, renderer, append=store.append if store else None)
            except ValueError as exc:
                return _fail(str(exc))
            s = res.summary()
            bad |= bool(s["mismatches"] or s["duplicates"])
            if args.json:
                print(json.dumps({"trace": path, **s}))
            else:
                print(
                    f"{os.path.basename(path)}: records={s['records']} skipped={s['skipped']} leaves={s['leaves']} "
                    f"leaves_by_role={s['leaves_by_role']} mismatches={s['mismatches']} "
                    f"duplicates={s['duplicates']} format_mismatches={s['format_mismatches']}"
                )
    finally:
        if store is not None:
            store.close()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
