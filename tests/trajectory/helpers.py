"""Shared builders for trajectory tests: records from plain lists, random executions."""

from __future__ import annotations

import os

import numpy as np

from gyre.trajectory import Provenance, RequestRecord

EXT, POL, EVL = int(Provenance.EXTERNAL), int(Provenance.POLICY), int(Provenance.EVALUATOR)
EID = "exec-1"


def examples(n: int) -> int:
    """Hypothesis example count: ``n`` scaled by ``$GYRE_HYPOTHESIS_SCALE`` (default 1) for deep runs."""
    return max(1, int(n * float(os.environ.get("GYRE_HYPOTHESIS_SCALE", "1"))))


def lp_for(out: list[int]) -> list[float]:
    """Deterministic, distinct behaviour log-probs for an output: -(token + 1) / 100 - index / 1000."""
    return [-(t + 1) / 100 - i / 1000 for i, t in enumerate(out)]


def rec(
    call: int,
    inp: list[int],
    out: list[int],
    role: str = "main",
    prov: list[int] | None = None,
    delivered: bool = True,
    version: int = 0,
    eid: str = EID,
) -> RequestRecord:
    """A record with ``input_ids=inp``, ``output_ids=out`` and log-probs from :func:`lp_for`."""
    return RequestRecord(
        execution_id=eid,
        call_index=call,
        role=role,
        input_ids=np.asarray(inp, np.int32),
        output_ids=np.asarray(out, np.int32),
        output_logprobs=np.asarray(lp_for(out), np.float32),
        input_provenance=None if prov is None else np.asarray(prov, np.int8),
        policy_version=version,
        engine_id="engine-0",
        delivered=delivered,
        timings={"total_s": 0.5 + call},
        finish_reason="stop",
        metadata={"harness": "test", "n": call},
    )


def full(r: RequestRecord) -> np.ndarray:
    """``input_ids ++ output_ids`` of a record."""
    return np.concatenate([r.input_ids, r.output_ids])


def full_prov(r: RequestRecord) -> np.ndarray:
    """Provenance of ``input_ids ++ output_ids`` as a later call would mark it."""
    return np.concatenate([r.input_provenance, r.output_provenance()])


def random_execution(draw_int, n_records: int, alphabet: int = 4, roles=("main", "subagent", "compaction", "auxiliary", "evaluator")) -> list[RequestRecord]:
    """A random execution built from ``draw_int(lo, hi)`` (inclusive): fresh contexts, extensions
    of earlier paths, branches at arbitrary points (also inside outputs), identical retries.

    A small ``alphabet`` makes accidental token sharing (and ties) likely.
    """
    records: list[RequestRecord] = []

    def toks(lo: int, hi: int) -> list[int]:
        return [draw_int(0, alphabet - 1) for _ in range(draw_int(lo, hi))]

    for i in range(n_records):
        kind = draw_int(0, 3) if records else 0
        if kind == 0:
            inp = np.asarray(toks(0, 5), np.int32)
            prov = np.full(len(inp), EXT, np.int8)
        else:
            base = records[draw_int(0, len(records) - 1)]
            seq, sprov = full(base), full_prov(base)
            if kind == 1:  # extend the whole path
                cut = len(seq)
            elif kind == 2:  # branch anywhere
                cut = draw_int(0, len(seq))
            else:  # identical retry of base's request
                seq, sprov = base.input_ids, base.input_provenance
                cut = len(seq)
            extra = toks(0 if kind == 3 else 1, 4) if kind != 3 else []
            inp = np.concatenate([seq[:cut], np.asarray(extra, np.int32)]).astype(np.int32)
            prov = np.concatenate([sprov[:cut], np.full(len(extra), EXT, np.int8)]).astype(np.int8)
        role = roles[draw_int(0, len(roles) - 1)]
        out = toks(0, 4)
        r = rec(i, inp.tolist(), out, role=role, prov=prov.tolist(), delivered=draw_int(0, 4) != 0, version=draw_int(0, 3))
        records.append(r)
    return records
