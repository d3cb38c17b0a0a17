#!/usr/bin/env python
"""Print or render a stored trajectory tree.

Usage::

    python tools/inspect_tree.py PATH [--json] [--html OUT.html] [--tokenizer DIR | --ids]

``PATH`` is one execution's record file written by :class:`gyre.trajectory.TrajectoryStore`
(``<root>/<execution_id>.jsonl``). The tree is rebuilt from its records.

* default: one line per node (role, tokens new/total, trainable count, delivered, policy
  version; indentation = branch depth) and a summary line;
* ``--json``: machine-readable stats with keys ``records, nodes, leaves, leaves_by_role,
  tokens_total, tokens_unique, trainable_tokens`` (``tokens_total``: sum of every call's
  input + output; ``tokens_unique``: tokens stored in the tree);
* ``--html OUT.html``: one self-contained page with expandable nodes and branches and
  "expand all" / "collapse all" buttons;
* ``--tokenizer DIR``: decode text with the ``transformers`` tokenizer in ``DIR``. Without it,
  when ``PATH`` is ``RUN/records/<id>.jsonl`` of a run directory, the text and HTML views decode
  with the run's own tokenizer (:func:`gyre.trajectory.tree_views.find_run_tokenizer`: the newest
  checkpoint's ``hf/``, else the run's ``model_dir`` or embedded tiny model) and say so on
  stderr; otherwise, or with ``--ids``, token ids are shown.

Exit status 0 on success, 2 on bad input (one-line message on stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gyre.trajectory.tree_views import (
    find_run_tokenizer,
    load_decoder,
    render_html,
    render_text,
    tree_stats,
)
from gyre.trajectory.admission import AdmissionConfig
from gyre.trajectory.store import StoreCorruptError, TornTailWarning, load_tree


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        sys.stderr.write(f"inspect_tree: error: {message}\n")
        sys.exit(2)


def _fail(message: str) -> int:
    sys.stderr.write(f"inspect_tree: error: {message}\n")
    return 2


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status."""
    ap = _Parser(prog="inspect_tree.py", description="Print or render a stored trajectory tree.")
    ap.add_argument("path", metavar="PATH", help="an execution's record file (<execution_id>.jsonl)")
    ap.add_argument("--json", action="store_true", help="print machine-readable stats")
    ap.add_argument("--html", metavar="OUT.html", help="write a self-contained HTML view")
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--tokenizer", metavar="DIR",
                       help="transformers tokenizer directory for decoding (default: the run's own, when PATH "
                            "is RUN/records/<id>.jsonl)")
    which.add_argument("--ids", action="store_true", help="show token ids, not text")
    ap.add_argument("--include-undelivered", action="store_true", help="count undelivered outputs as trainable")
    ap.add_argument("--max-tokens", type=int, default=4000, help="tokens shown per node in HTML (0 = all)")
    args = ap.parse_args(argv)

    if not os.path.isfile(args.path):
        return _fail(f"{args.path}: no such record file")
    if args.max_tokens < 0:
        return _fail("--max-tokens must be >= 0")
    config = AdmissionConfig(include_undelivered=args.include_undelivered)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", TornTailWarning)
            tree = load_tree(args.path)
        for w in caught:
            sys.stderr.write(f"inspect_tree: warning: {w.message}\n")
    except (StoreCorruptError, ValueError, OSError) as e:
        return _fail(f"{args.path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    decode = None
    if args.tokenizer is not None:
        try:
            decode = load_decoder(args.tokenizer)
        except Exception as e:  # transformers raises many types for a bad directory
            return _fail(f"--tokenizer {args.tokenizer}: cannot load a tokenizer ({type(e).__name__})")
    elif not args.ids and not (args.json and not args.html):  # a view that shows text
        found = find_run_tokenizer(args.path)
        if found is not None:
            try:
                decode = load_decoder(found)
                sys.stderr.write(f"inspect_tree: decoding with the run's tokenizer {found} (--ids for token ids)\n")
            except Exception as e:  # transformers raises many types for a bad directory
                sys.stderr.write(f"inspect_tree: warning: {found}: cannot load a tokenizer ({type(e).__name__}); "
                                 "showing token ids\n")
    if args.html:
        try:
            with open(args.html, "w", encoding="utf-8") as f:
                title = os.path.basename(args.path)
                f.write(render_html(tree, decode, config, max_tokens=args.max_tokens, title=title))
        except OSError as e:
            return _fail(f"--html {args.html}: {e.strerror or e}")
    if args.json:
        print(json.dumps(tree_stats(tree, config), sort_keys=False))
    elif args.html:
        print(f"wrote {args.html}")
    else:
        sys.stdout.write(render_text(tree, config, decode))
    return 0


if __name__ == "__main__":
    sys.exit(main())
