"""Benchmark: trajectory-tree insert, memory and admission sampling on one long execution.

Builds one synthetic execution of ``--calls`` model calls (default 500) whose contexts total
~1M unique tokens: a main agent that grows its context by a few hundred to a few thousand
tokens per call, compacts it when it passes ``--compact-at`` tokens (a ``compaction`` call,
then a new context that starts from the summary), spawns sub-agents in fresh contexts,
makes a few auxiliary calls, has some outputs edited by the harness (tool JSON
re-serialised -> branch inside the output) and a few retried identical requests (every
output starts with ``<think>``, so retried outputs form ambiguous branching points).

Prints insert time total and per call, memory per stored token, sampling and
materialisation time, and dedup statistics. Optionally (``--store DIR``) appends every
record to a record store, reloads the tree and checks it is bit-identical.

Usage: ``python bench/tree.py [--calls 500] [--seed 0] [--store DIR]``
Target: ≤ 0.5 s total insert for 500 calls / ~1M tokens.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
import tracemalloc
from typing import Iterator

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gyre.trajectory import (
    AdmissionConfig,
    Provenance,
    RequestRecord,
    TrajectoryStore,
    TrajectoryTree,
    dedup_stats,
    materialize,
    sample_trajectories,
)

VOCAB = 150_000
THINK = 151_667  # every output starts with <think>, so retried outputs share a first token
EXT, POL = int(Provenance.EXTERNAL), int(Provenance.POLICY)


class _Context:
    """A growing context: token ids and provenance (amortised append)."""

    def __init__(self) -> None:
        self.ids = np.empty(1 << 16, np.int32)
        self.prov = np.empty(1 << 16, np.int8)
        self.n = 0

    def add(self, ids: np.ndarray, prov: int) -> None:
        m = self.n + ids.shape[0]
        if m > self.ids.shape[0]:
            cap = max(m, 2 * self.ids.shape[0])
            self.ids = np.concatenate([self.ids[: self.n], np.empty(cap - self.n, np.int32)])
            self.prov = np.concatenate([self.prov[: self.n], np.empty(cap - self.n, np.int8)])
        self.ids[self.n:m] = ids
        self.prov[self.n:m] = prov
        self.n = m

    def snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        return self.ids[: self.n].copy(), self.prov[: self.n].copy()


def generate(calls: int, seed: int, compact_at: int) -> Iterator[RequestRecord]:
    """Yield the execution's records in completion order (see module docstring)."""
    rng = np.random.default_rng(seed)
    eid = "bench-exec"
    idx = 0

    def toks(lo: int, hi: int) -> np.ndarray:
        return rng.integers(0, VOCAB, int(rng.integers(lo, hi)), dtype=np.int32)

    def make(ctx: _Context, role: str, out: np.ndarray, delivered: bool = True) -> RequestRecord:
        nonlocal idx
        out[0] = THINK
        ids, prov = ctx.snapshot()
        lp = -rng.random(out.shape[0], dtype=np.float32) * 3
        r = RequestRecord(eid, idx, role, ids, out, lp, prov, policy_version=idx // 50,
                          engine_id="cell-1", delivered=delivered, finish_reason="stop")
        idx += 1
        return r

    system = toks(1800, 2200)
    task = toks(300, 700)
    main = _Context()
    main.add(system, EXT)
    main.add(task, EXT)
    sub_system = toks(1200, 1600)
    while idx < calls:
        kind = rng.random()
        if main.n > compact_at and idx + 2 <= calls:
            # compaction call on the full history, then a fresh context from the summary
            main.add(toks(150, 250), EXT)
            summary = toks(1500, 2500)
            yield make(main, "compaction", summary)
            main = _Context()
            main.add(system, EXT)
            main.add(toks(20, 40), EXT)
            main.add(summary, POL)
            main.add(task, EXT)
            continue
        if kind < 0.03 and idx + 16 <= calls:
            # sub-agent: fresh context, ~12 calls, result returned to main as a tool result
            sub = _Context()
            sub.add(sub_system, EXT)
            sub.add(toks(200, 400), EXT)
            for _ in range(int(rng.integers(8, 16))):
                out = toks(100, 1200)
                yield make(sub, "subagent", out)
                sub.add(out, POL)
                sub.add(toks(200, 2500), EXT)
            main.add(toks(300, 800), EXT)
            continue
        if kind < 0.04:
            aux = _Context()
            aux.add(toks(300, 600), EXT)
            yield make(aux, "auxiliary", toks(5, 30))
            continue
        out = toks(100, 1500)
        if kind < 0.06:
            # retried identical request: the first response never reached the harness
            yield make(main, "main", toks(100, 1500), delivered=False)
        yield make(main, "main", out)
        if rng.random() < 0.2 and out.shape[0] > 20:
            # harness re-serialises the tool-call JSON: the context diverges inside the output
            cut = int(rng.integers(1, out.shape[0] - 1))
            main.add(out[:cut], POL)
            main.add(toks(5, 20), EXT)
        else:
            main.add(out, POL)
        main.add(toks(100, 2500), EXT)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compact-at", type=int, default=120_000, help="context tokens that trigger compaction")
    ap.add_argument("--anchor-slots", type=int, default=8)
    ap.add_argument("--j-max", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3, help="insert runs; the best is reported")
    ap.add_argument("--store", default=None, help="also write a record store here and reload it")
    args = ap.parse_args(argv)

    records = list(generate(args.calls, args.seed, args.compact_at))
    context_tokens = sum(r.num_input_tokens + r.num_output_tokens for r in records)

    best = None
    for _ in range(args.repeats):
        gc.collect()
        tree = TrajectoryTree(anchor_slots=args.anchor_slots)
        per = np.empty(len(records))
        gc.disable()
        for i, r in enumerate(records):
            t0 = time.perf_counter()
            tree.insert(r)
            per[i] = time.perf_counter() - t0
        gc.enable()
        if best is None or per.sum() < best[1].sum():
            best = (tree, per)
    tree, per = best

    # memory: traced allocations of a fresh build (Python objects + arrays), anchors excluded
    gc.collect()
    tracemalloc.start()
    t2 = TrajectoryTree(anchor_slots=args.anchor_slots)
    base = tracemalloc.get_traced_memory()[0]
    for r in records:
        t2.insert(r)
    traced = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert t2.digest() == tree.digest()

    rng = np.random.default_rng(args.seed)
    cfg = AdmissionConfig(j_max=args.j_max)
    t0 = time.perf_counter()
    adm = sample_trajectories(tree, rng, cfg)
    t_sample = time.perf_counter() - t0
    t0 = time.perf_counter()
    rows = materialize(tree, adm, advantage=0.0)
    t_mat = time.perf_counter() - t0
    t0 = time.perf_counter()
    adm_all = sample_trajectories(tree, np.random.default_rng(args.seed), AdmissionConfig(j_max=None))
    t_sample_all = time.perf_counter() - t0
    stats = dedup_stats(tree, adm, rows)

    roles: dict[str, int] = {}
    for r in tree.records:
        roles[r.role] = roles.get(r.role, 0) + 1
    n_tok = tree.num_tokens
    print(f"execution: {len(records)} calls {roles}")
    print(f"  unique tokens {n_tok:,}  per-call context tokens {context_tokens:,}  nodes {tree.num_nodes}  "
          f"leaves {len(tree.leaves())}")
    print(f"insert: total {per.sum():.3f} s  per call mean {per.mean() * 1e3:.3f} ms  "
          f"p50 {np.median(per) * 1e3:.3f} ms  p99 {np.quantile(per, 0.99) * 1e3:.3f} ms  "
          f"max {per.max() * 1e3:.3f} ms  (best of {args.repeats}; target <= 0.5 s total)")
    print(f"memory: arrays {tree.nbytes() / n_tok:.2f} B/token  traced (arrays + objects) "
          f"{traced / n_tok:.2f} B/token ({traced / 2**20:.1f} MiB)  "
          f"+ insert index (anchors) {tree.anchor_nbytes() / 2**20:.1f} MiB")
    print(f"sampling: J_max={args.j_max}: {t_sample * 1e3:.2f} ms ({len(adm.trajectories)} trajectories, "
          f"L_i={adm.num_targets:,});  J_max=inf: {t_sample_all * 1e3:.1f} ms "
          f"({len(adm_all.trajectories)} trajectories, L_i={adm_all.num_targets:,})")
    print(f"materialise: {t_mat * 1e3:.2f} ms for {len(rows)} rows")
    print(f"dedup: tree {stats.tree_tokens:,} tokens  trainable {stats.trainable_tokens:,}  "
          f"targets {stats.targets_admitted:,}  row tokens {stats.row_tokens:,}  "
          f"flattened paths {stats.flattened_path_tokens:,}  per-call {stats.per_call_tokens:,}")

    if args.store is not None:
        root = args.store or tempfile.mkdtemp(prefix="gyre-bench-store-")
        with TrajectoryStore(root, fsync_every=0) as store:
            path = store.path(records[0].execution_id)
            if path.exists():
                path.unlink()
            t0 = time.perf_counter()
            for r in records:
                store.append(r)
            store.close()
            t_w = time.perf_counter() - t0
            t0 = time.perf_counter()
            loaded = store.load_tree(records[0].execution_id, anchor_slots=args.anchor_slots)
            t_l = time.perf_counter() - t0
        same = loaded.digest() == tree.digest()
        print(f"store: {path}  {os.path.getsize(path) / 2**20:.1f} MiB "
              f"({os.path.getsize(path) / n_tok:.2f} B/token)  append {t_w:.2f} s  load+rebuild {t_l:.2f} s  "
              f"bit-identical {same}")
        if not same:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
