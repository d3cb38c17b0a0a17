"""Human views of a trajectory tree: stats, a text tree and a self-contained HTML page.

Used by ``tools/inspect_tree.py``. Text decoding goes through one function,
:func:`load_decoder`; without a tokenizer the views show token ids. :func:`find_run_tokenizer`
finds the tokenizer of the run a record file belongs to.
"""

from __future__ import annotations

import html
import json
import os
from pathlib import Path
from typing import Any, Callable

import numpy as np

from gyre.trajectory.records import Provenance
from gyre.trajectory.admission import AdmissionConfig, eligible_nodes, node_trainable_mask, trainable_counts
from gyre.trajectory.tree import ROOT, TrajectoryTree

__all__ = ["Decoder", "load_decoder", "ids_decoder", "find_run_tokenizer", "tree_stats", "render_text",
           "render_html"]

#: Turns ``int32[n]`` token ids into display text.
Decoder = Callable[[np.ndarray], str]


def ids_decoder(ids: np.ndarray) -> str:
    """Fallback decoder: token ids separated by spaces."""
    return " ".join(str(int(t)) for t in ids)


def load_decoder(tokenizer_dir: str | None) -> Decoder:
    """A decoder for token ids: a ``transformers`` tokenizer from ``tokenizer_dir`` (loaded with
    ``AutoTokenizer.from_pretrained(dir, local_files_only=True)``), or :func:`ids_decoder` when
    ``tokenizer_dir`` is ``None``.

    Raises:
        OSError / ValueError: the directory holds no loadable tokenizer.
    """
    if tokenizer_dir is None:
        return ids_decoder
    from transformers import AutoTokenizer  # slow import; only when asked for

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)

    def decode(ids: np.ndarray) -> str:
        return tok.decode([int(t) for t in ids], skip_special_tokens=False)

    return decode


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _has_tokenizer(directory: Path) -> bool:
    return directory.is_dir() and any((directory / f).is_file() for f in _TOKENIZER_FILES)


def _checkpoint_iteration(path: Path) -> int:
    digits = path.name.removeprefix("iter_")
    return int(digits) if digits.isdigit() else -1


def find_run_tokenizer(record_path: str | os.PathLike) -> Path | None:
    """The tokenizer directory of the run whose ``RUN/records/<id>.jsonl`` is ``record_path``.

    ``None`` when the file does not lie in a ``records/`` directory of a run (a directory with
    ``args.json`` or ``checkpoints/``) or no tokenizer is found. Tried in order:

    1. ``RUN/checkpoints/iter_N/hf`` of the highest ``N`` that holds ``tokenizer.json`` or
       ``tokenizer_config.json`` (checkpoints save the tokenizer with the policy);
    2. ``model_dir`` of ``RUN/args.json`` when it holds a tokenizer;
    3. when ``model_dir`` is ``null``: the embedded tiny model the run used,
       :func:`gyre.embedded_model.ensure_tiny_model` of the run's ``tokenizer_kind`` and
       ``model_cache_dir`` (built into the cache when missing; ``None`` when that fails).
    """
    records = Path(record_path).resolve().parent
    run = records.parent
    if records.name != "records" or not ((run / "args.json").is_file() or (run / "checkpoints").is_dir()):
        return None
    ckpts = sorted((p for p in (run / "checkpoints").glob("iter_*") if _checkpoint_iteration(p) >= 0),
                   key=_checkpoint_iteration, reverse=True)
    for ckpt in ckpts:
        if _has_tokenizer(ckpt / "hf"):
            return ckpt / "hf"
    try:
        args = json.loads((run / "args.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(args, dict):
        return None
    model_dir = args.get("model_dir")
    if model_dir:
        return Path(model_dir) if _has_tokenizer(Path(model_dir)) else None
    kind = args.get("tokenizer_kind") or "local"
    if kind not in ("qwen", "local"):
        return None
    try:
        from gyre.embedded_model import ensure_tiny_model

        found = ensure_tiny_model(kind, args.get("model_cache_dir"))
    except (ImportError, OSError):  # no dashscope (the BPE source) or an unwritable cache
        return None
    return found if _has_tokenizer(found) else None


def tree_stats(tree: TrajectoryTree, config: AdmissionConfig | None = None) -> dict[str, Any]:
    """Machine-readable stats (a fixed set of keys).

    * ``records`` -- records inserted; ``nodes`` -- nodes (root excluded); ``leaves``;
    * ``leaves_by_role`` -- ``{role: leaves}`` (role of the leaf's record), sorted by role;
    * ``tokens_total`` -- sum over records of ``input + output`` tokens (what the calls
      processed);
    * ``tokens_unique`` -- tokens stored in the tree;
    * ``trainable_tokens`` -- trainable tokens under ``config`` (default admission settings).
    """
    leaves = tree.leaves()
    by_role: dict[str, int] = {}
    for leaf in leaves:
        r = tree.role(leaf)
        by_role[r] = by_role.get(r, 0) + 1
    return {
        "records": len(tree.records),
        "nodes": tree.num_nodes,
        "leaves": len(leaves),
        "leaves_by_role": dict(sorted(by_role.items())),
        "tokens_total": sum(r.num_input_tokens + r.num_output_tokens for r in tree.records),
        "tokens_unique": tree.num_tokens,
        "trainable_tokens": int(trainable_counts(tree, config).sum()),
    }


def _subtree_sizes(tree: TrajectoryTree) -> list[int]:
    sizes = [1] * len(tree.nodes)
    for nid, _ in reversed(list(tree.iter_preorder())):
        parent = tree.nodes[nid].parent
        if parent > ROOT:
            sizes[parent] += sizes[nid]
    return sizes


def _layout(tree: TrajectoryTree) -> list[tuple[str, int, int]]:
    """Pre-order events: ``("node", id, level)`` / ``("open", branch_head, level)`` / ``("close", 0, level)``.

    At a branching node the child with the largest subtree (the last one on ties) continues
    on the same level, after the other children, each of which opens a nested branch. So a
    long main thread stays flat and side branches (edited outputs, retries, compaction
    calls, sub-agents) nest one level. Iterative (trees can be thousands of nodes deep).
    """
    sizes = _subtree_sizes(tree)
    events: list[tuple[str, int, int]] = []
    stack: list[tuple[str, int, int]] = []  # ("visit"|"branch"|"close", nid, level)

    def push_children(kids: list[int], level: int) -> None:
        if not kids:
            return
        main = max(range(len(kids)), key=lambda i: (sizes[kids[i]], i))
        stack.append(("visit", kids[main], level))  # popped last: continues the level
        for i in range(len(kids) - 1, -1, -1):
            if i != main:
                stack.append(("branch", kids[i], level))

    push_children(tree.nodes[ROOT].children, 0)
    while stack:
        kind, nid, level = stack.pop()
        if kind == "close":
            events.append(("close", 0, level))
            continue
        if kind == "branch":
            events.append(("open", nid, level))
            stack.append(("close", 0, level))
            level += 1
        events.append(("node", nid, level))
        push_children(tree.nodes[nid].children, level)
    return events


def _node_line(tree: TrajectoryTree, nid: int, counts: np.ndarray) -> str:
    nd = tree.nodes[nid]
    rec = tree.records[nd.record]
    leaf = " leaf" if not nd.children else ""
    return (
        f"#{nid} {rec.role} call={rec.call_index} v={rec.policy_version} "
        f"new={nd.num_tokens} (in {nd.n_input} / out {nd.num_output}) total={nd.end} "
        f"trainable={int(counts[nid])} delivered={'yes' if rec.delivered else 'no'} "
        f"finish={rec.finish_reason}{leaf}"
    )


def _summary_line(tree: TrajectoryTree, stats: dict[str, Any]) -> str:
    roles = ", ".join(f"{k} {v}" for k, v in stats["leaves_by_role"].items())
    return (
        f"execution {tree.execution_id}: {stats['records']} records, {stats['nodes']} nodes, "
        f"{stats['leaves']} leaves ({roles}); tokens total {stats['tokens_total']}, "
        f"unique {stats['tokens_unique']}, trainable {stats['trainable_tokens']}"
    )


def render_text(
    tree: TrajectoryTree, config: AdmissionConfig | None = None, decode: Decoder | None = None, preview: int = 60
) -> str:
    """The tree as indented text (one line per node, indent = branch depth) and a summary.

    With ``decode``, each line ends with a ``preview``-character excerpt of the node's text.
    """
    counts = trainable_counts(tree, config)
    lines: list[str] = []
    for kind, nid, level in _layout(tree):
        if kind == "open":
            lines.append("  " * level + f"+ branch at token {tree.nodes[nid].start}")
        elif kind == "node":
            line = "  " * level + _node_line(tree, nid, counts)
            if decode is not None:
                text = decode(tree.nodes[nid].tokens)
                if len(text) > preview:
                    text = text[:preview] + "..."
                line += "  " + json.dumps(text, ensure_ascii=False)
            lines.append(line)
    lines.append(_summary_line(tree, tree_stats(tree, config)))
    return "\n".join(lines) + "\n"


_CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}
summary{cursor:pointer;font-family:ui-monospace,monospace;font-size:13px;padding:2px 0}
details.branch{border-left:3px solid #8aa4d6;margin:4px 0 4px 6px;padding-left:8px}
details.node{margin:2px 0}
.text{white-space:pre-wrap;font-family:ui-monospace,monospace;font-size:12px;border:1px solid #ddd;
 padding:6px;margin:4px 0 8px 14px;max-height:40em;overflow:auto;background:#fafafa}
.ext{color:#333}.pol{background:#d9f2d9}.evl{background:#f9e0c7}.out{background:#c9e7ff}
.tgt{background:#9fd3ff;font-weight:600}.cut{color:#999;font-style:italic}
.role-main{color:#1a5}.role-subagent{color:#a51}.role-compaction{color:#15a}.role-auxiliary{color:#777}
.role-evaluator{color:#a15}
table{border-collapse:collapse;margin:.5em 0}td{padding:2px 10px;border-bottom:1px solid #eee}
"""


# display classes indexed by code: input provenance values first, then output/trainable/elided
_CLASSES = {int(Provenance.POLICY): "pol", int(Provenance.EXTERNAL): "ext", int(Provenance.EVALUATOR): "evl",
            3: "out", 4: "tgt", 5: "cut"}


def _node_html(
    tree: TrajectoryTree, nid: int, decode: Decoder, config: AdmissionConfig | None, max_tokens: int,
    eligible: np.ndarray,
) -> str:
    nd = tree.nodes[nid]
    n = nd.num_tokens
    # display class per token: input by provenance (0..2), output 3, trainable output 4, elided 5
    code = np.empty(n, np.int8)
    code[: nd.n_input] = nd.provenance[: nd.n_input]
    code[nd.n_input:] = 3
    code[node_trainable_mask(tree, nid, config, eligible)] = 4
    if max_tokens and n > max_tokens:
        code[max_tokens // 2: n - max_tokens // 2] = 5
    cuts = np.flatnonzero(np.diff(code)) + 1
    bounds = [0, *cuts.tolist(), n] if n else [0]
    parts: list[str] = []
    for i, j in zip(bounds[:-1], bounds[1:]):
        c = int(code[i])
        if c == 5:
            parts.append(f'<span class="cut">[... {j - i} tokens ...]</span>')
            continue
        text = decode(nd.tokens[i:j])
        if decode is ids_decoder and parts:
            text = " " + text
        parts.append(f'<span class="{_CLASSES[c]}">{html.escape(text)}</span>')
    return "".join(parts)


def render_html(
    tree: TrajectoryTree,
    decode: Decoder | None = None,
    config: AdmissionConfig | None = None,
    max_tokens: int = 4000,
    title: str | None = None,
) -> str:
    """One self-contained HTML page (inline CSS and script, no external resources).

    Each node is a ``<details>`` (summary: role, tokens new/total, trainable, delivered,
    policy version; body: its text, coloured by provenance: external, policy-in-context,
    evaluator, output, *trainable output*). Each branch is a nested, open ``<details>``.
    Nodes longer than ``max_tokens`` show their first and last ``max_tokens / 2`` tokens.
    Two buttons at the top, "expand all" and "collapse all", open or close every ``<details>``
    (a one-line inline script).
    """
    decode = decode or ids_decoder
    counts = trainable_counts(tree, config)
    eligible = eligible_nodes(tree, config)
    stats = tree_stats(tree, config)
    title = title or f"trajectory tree {tree.execution_id}"
    out: list[str] = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f"<p>{html.escape(_summary_line(tree, stats))}</p>",
        "<table>" + "".join(
            f"<tr><td>{html.escape(k)}</td><td>{html.escape(json.dumps(v))}</td></tr>" for k, v in stats.items()
        ) + "</table>",
        '<p>Legend: <span class="ext">external</span> <span class="pol">policy tokens in context</span> '
        '<span class="evl">evaluator</span> <span class="out">output (not trainable)</span> '
        '<span class="tgt">trainable output</span></p>',
        '<p><button type="button" onclick="gyreSetAll(true)">expand all</button> '
        '<button type="button" onclick="gyreSetAll(false)">collapse all</button></p>',
        "<script>function gyreSetAll(o){document.querySelectorAll('details').forEach("
        "function(d){d.open=o;});}</script>",
    ]
    for kind, nid, _level in _layout(tree):
        if kind == "open":
            nd = tree.nodes[nid]
            out.append(
                f'<details class="branch" open><summary>branch at token {nd.start} '
                f"(#{nid}, {html.escape(tree.role(nid))})</summary>"
            )
        elif kind == "close":
            out.append("</details>")
        else:
            role = tree.role(nid)
            out.append(
                f'<details class="node"><summary class="role-{html.escape(role)}">'
                f"{html.escape(_node_line(tree, nid, counts))}</summary>"
                f'<div class="text">{_node_html(tree, nid, decode, config, max_tokens, eligible)}</div></details>'
            )
    out.append("</body></html>")
    return "\n".join(out) + "\n"
