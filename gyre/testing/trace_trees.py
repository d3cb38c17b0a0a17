"""Trajectory trees shaped like the recorded harness traces, with random token ids.

A cheap, scalable stand-in for real replays (:func:`gyre.proxy.replay.replay_trace` gives the real
token trees, whose 9k-19k-token rows are more than CPU unit tests can afford): only the structure
and the sizes come from the trace. Each successful model call (not ``injected``) becomes one
:class:`~gyre.trajectory.records.RequestRecord` with the trace's ``kind`` as role (``main_text`` ->
``main``). ``main`` calls extend the main context window, ``subagent`` calls a sub-agent window
started fresh, a ``compaction`` call branches off the main window (dropping its newest assistant
turn; with a different tool list it shares only the template header) and the next ``main`` call
opens a new window sharing the system prompt and tools. Sizes in tokens are JSON character counts
divided by ``chars_per_token`` and multiplied by ``scale``. So the trees have the long shared
prefixes, compaction branches and sub-agent root branches of the real runs.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gyre.trajectory import (AdmissionConfig, Provenance, RequestRecord, TrajectoryRow, TrajectoryTree, materialize,
                             sample_trajectories)

__all__ = ["TraceCall", "read_trace_calls", "trace_shaped_rows", "trace_shaped_tree"]

_HEADER = np.asarray([1, 2, 3], np.int32)  # "<|im_start|>system\n" stand-in shared by every context


@dataclass(slots=True)
class TraceCall:
    """Sizes of one successful model call of a trace (JSON characters)."""

    kind: str
    prefix_chars: int  # system prompt + tools
    prefix_key: tuple[int, int]
    messages_chars: int
    output_chars: int


def read_trace_calls(path: str | Path) -> list[TraceCall]:
    """Successful model calls of one trace file, in order.

    Raises:
        ValueError: the file holds no model call.
    """
    calls: list[TraceCall] = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        kind, body = rec.get("kind"), rec.get("body")
        if rec.get("injected") or kind not in ("main", "main_text", "subagent", "compaction", "auxiliary"):
            continue
        if not isinstance(body, dict):
            continue
        msgs = body.get("messages", body.get("input", []))
        system = body.get("system", "")
        tools = body.get("tools", [])
        s_chars, t_chars = len(json.dumps(system)), len(json.dumps(tools))
        reply = (rec.get("response") or {}).get("message")
        calls.append(TraceCall("main" if kind == "main_text" else kind, s_chars + t_chars, (s_chars, t_chars),
                               len(json.dumps(msgs)), len(json.dumps(reply)) if reply else 1))
    if not calls:
        raise ValueError(f"{path}: no model call")
    return calls


def trace_shaped_tree(path: str | Path, rng: np.random.Generator, scale: float = 1 / 64,
                      chars_per_token: float = 4.0, vocab: int = 4000,
                      execution_id: str | None = None) -> TrajectoryTree:
    """Build a :class:`~gyre.trajectory.tree.TrajectoryTree` with ``path``'s structure (see module doc).

    Args:
        path: a ``*.jsonl`` harness trace.
        rng: source of token ids and behaviour log-probs.
        scale: token count multiplier (1 = the trace's size at ``chars_per_token``).
        vocab: token ids are drawn from ``[4, vocab)``.
        execution_id: default: the file stem with ``_`` -> ``-``.
    """
    calls = read_trace_calls(path)
    eid = execution_id or Path(path).stem.replace("_", "-")
    ntok = lambda chars: max(1, int(math.ceil(chars / chars_per_token * scale)))  # noqa: E731
    prefixes: dict[tuple[int, int], np.ndarray] = {}

    def prefix(call: TraceCall) -> np.ndarray:
        if call.prefix_key not in prefixes:
            ids = rng.integers(4, vocab, ntok(call.prefix_chars))
            prefixes[call.prefix_key] = np.concatenate([_HEADER, ids]).astype(np.int32)
        return prefixes[call.prefix_key]

    tree = TrajectoryTree(eid)
    # window state: (tokens, provenance, last output tokens, messages chars incl. last reply, prefix key)
    windows: dict[str, tuple[np.ndarray, np.ndarray, int, int, tuple[int, int]]] = {}
    new_main_window = False
    for i, call in enumerate(calls):
        key = "subagent" if call.kind == "subagent" else "main"
        if call.kind == "compaction" or call.kind == "auxiliary":
            base = windows.get("main")
            if call.kind == "compaction" and base is not None and base[4] == call.prefix_key:
                toks, prov, last_out, mchars, _ = base
                keep = toks.shape[0] - last_out  # drop the newest assistant turn
                extra = ntok(max(1, call.messages_chars - mchars))
                inp = np.concatenate([toks[:keep], rng.integers(4, vocab, extra)]).astype(np.int32)
                iprov = np.concatenate([prov[:keep], np.full(extra, int(Provenance.EXTERNAL), np.int8)])
            else:
                p = prefix(call)
                inp = np.concatenate([p, rng.integers(4, vocab, ntok(call.messages_chars))]).astype(np.int32)
                iprov = np.full(inp.shape[0], int(Provenance.EXTERNAL), np.int8)
            if call.kind == "compaction":
                new_main_window = True
        else:
            win = windows.get(key)
            if win is None or (key == "main" and new_main_window):
                p = prefix(call)
                inp = np.concatenate([p, rng.integers(4, vocab, ntok(call.messages_chars))]).astype(np.int32)
                iprov = np.full(inp.shape[0], int(Provenance.EXTERNAL), np.int8)
                if key == "main":
                    new_main_window = False
            else:
                toks, prov, last_out, mchars, _ = win
                extra = ntok(max(1, call.messages_chars - mchars))
                inp = np.concatenate([toks, rng.integers(4, vocab, extra)]).astype(np.int32)
                iprov = np.concatenate([prov, np.full(extra, int(Provenance.EXTERNAL), np.int8)])
        out = rng.integers(4, vocab, ntok(call.output_chars)).astype(np.int32)
        lps = -rng.uniform(0.01, 3.0, out.shape[0]).astype(np.float32)
        rec = RequestRecord(execution_id=eid, call_index=i, role=call.kind, input_ids=inp, output_ids=out,
                            output_logprobs=lps, input_provenance=iprov, policy_version=0, engine_id="trace")
        tree.insert(rec)
        if call.kind in ("main", "subagent"):
            windows[key] = (np.concatenate([inp, out]),
                            np.concatenate([iprov, np.full(out.shape[0], int(Provenance.POLICY), np.int8)]),
                            int(out.shape[0]), call.messages_chars + call.output_chars, call.prefix_key)
    return tree


def trace_shaped_rows(path: str | Path, rng: np.random.Generator, advantage: float = 1.0, scale: float = 1 / 64,
                      j_max: int | None = 5, execution_id: str | None = None, **kw) -> list[TrajectoryRow]:
    """Admitted, materialised rows of :func:`trace_shaped_tree` (``J_max = j_max``), advantage filled."""
    tree = trace_shaped_tree(path, rng, scale=scale, execution_id=execution_id, **kw)
    adm = sample_trajectories(tree, rng, AdmissionConfig(j_max=j_max))
    return materialize(tree, adm, advantage)
