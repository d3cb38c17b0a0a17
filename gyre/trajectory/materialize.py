"""Materialisation: admitted trajectories -> training token rows, and dedup statistics.

Each admitted trajectory becomes one row holding its full root-to-leaf token sequence (the
original context of every target), a target mask and the behaviour log-probs aligned to
the tokens. Alignment convention: position ``t`` describes token ``input_ids[t]``;
``behaviour_logprobs[t] = log pi_behaviour(input_ids[t] | input_ids[:t])`` where
``target_mask[t]``, and 0.0 elsewhere. The trainer shifts logits by one as usual.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from gyre.trajectory.admission import Admission, eligible_nodes, node_trainable_mask
from gyre.trajectory.tree import TrajectoryTree

__all__ = ["TrajectoryRow", "DedupStats", "materialize", "dedup_stats"]


@dataclass(slots=True)
class TrajectoryRow:
    """One training row (one admitted trajectory).

    * ``execution_id`` -- the execution the row belongs to.
    * ``input_ids`` -- ``int32[T]``: root-to-leaf token ids.
    * ``target_mask`` -- ``bool[T]``: True at this row's targets.
    * ``behaviour_logprobs`` -- ``float32[T]``: behaviour log-prob of each target token,
      0.0 where ``target_mask`` is False.
    * ``num_execution_targets`` -- ``L_i``: targets over *all* admitted trajectories of the
      execution (the GSPO ratio and the ``1/L_i`` weight use it).
    * ``advantage`` -- ``A_i``; NaN until the group's advantage is computed.
    * ``num_targets`` -- targets in this row; ``leaf``/``role`` -- the drawn leaf and class;
      ``policy_version_min``/``policy_version_max`` -- over the records owning this row's
      targets (staleness accounting).
    """

    execution_id: str
    input_ids: np.ndarray
    target_mask: np.ndarray
    behaviour_logprobs: np.ndarray
    num_execution_targets: int
    advantage: float
    num_targets: int
    leaf: int
    role: str
    policy_version_min: int
    policy_version_max: int

    @property
    def L_i(self) -> int:
        """Alias of ``num_execution_targets`` (paper notation)."""
        return self.num_execution_targets

    @property
    def num_tokens(self) -> int:
        """``T``, tokens in the row."""
        return int(self.input_ids.shape[0])


@dataclass(slots=True)
class DedupStats:
    """Token accounting for one execution (all counts in tokens).

    * ``tree_tokens`` -- unique tokens stored in the tree;
    * ``trainable_tokens`` -- trainable tokens in the tree (before the ``J_max`` cut);
    * ``targets_admitted`` -- ``L_i``;
    * ``row_tokens`` -- tokens in the materialised rows (what training processes);
    * ``flattened_path_tokens`` -- sum over *all* leaves of the root-to-leaf length (cost of
      training every trajectory as its own row);
    * ``per_call_tokens`` -- sum over records of ``input + output`` (cost of one row per
      model call);
    * ``rows`` / ``leaves`` -- row and leaf counts.
    """

    tree_tokens: int
    trainable_tokens: int
    targets_admitted: int
    row_tokens: int
    flattened_path_tokens: int
    per_call_tokens: int
    rows: int
    leaves: int


def materialize(
    tree: TrajectoryTree, admission: Admission, advantage: float = math.nan
) -> list[TrajectoryRow]:
    """Turn an :class:`Admission` into rows, in draw order.

    Args:
        tree: the tree the admission was sampled from.
        admission: output of :func:`gyre.trajectory.admission.sample_trajectories`.
        advantage: ``A_i`` for every row (default NaN placeholder, filled later).

    Raises:
        ValueError: the admission's target count disagrees with the tree (wrong tree).
    """
    rows: list[TrajectoryRow] = []
    cfg = admission.config
    eligible = eligible_nodes(tree, cfg)
    for traj in admission.trajectories:
        target_set = set(traj.target_nodes)
        toks, masks, lps = [], [], []
        versions: list[int] = []
        for nid in traj.path:
            nd = tree.nodes[nid]
            toks.append(nd.tokens)
            lp = np.zeros(nd.num_tokens, np.float32)
            if nid in target_set:
                m = node_trainable_mask(tree, nid, cfg, eligible)
                lp[nd.n_input:] = nd.logprobs
                lp[~m] = 0.0
                versions.append(tree.records[nd.record].policy_version)
            else:
                m = np.zeros(nd.num_tokens, bool)
            masks.append(m)
            lps.append(lp)
        mask = np.concatenate(masks) if masks else np.zeros(0, bool)
        n_t = int(mask.sum())
        if n_t != traj.num_targets:
            raise ValueError(f"trajectory at leaf {traj.leaf}: {n_t} targets in tree, "
                             f"admission says {traj.num_targets}")
        rows.append(
            TrajectoryRow(
                execution_id=admission.execution_id,
                input_ids=np.concatenate(toks) if toks else np.zeros(0, np.int32),
                target_mask=mask,
                behaviour_logprobs=np.concatenate(lps) if lps else np.zeros(0, np.float32),
                num_execution_targets=admission.num_targets,
                advantage=float(advantage),
                num_targets=n_t,
                leaf=traj.leaf,
                role=traj.role,
                policy_version_min=min(versions) if versions else -1,
                policy_version_max=max(versions) if versions else -1,
            )
        )
    return rows


def dedup_stats(tree: TrajectoryTree, admission: Admission, rows: list[TrajectoryRow] | None = None) -> DedupStats:
    """Dedup statistics for one execution (what flattening every path would cost)."""
    if rows is None:
        rows = materialize(tree, admission)
    leaves = tree.leaves()
    return DedupStats(
        tree_tokens=tree.num_tokens,
        trainable_tokens=admission.trainable_tokens,
        targets_admitted=admission.num_targets,
        row_tokens=sum(r.num_tokens for r in rows),
        flattened_path_tokens=sum(tree.nodes[leaf].end for leaf in leaves),
        per_call_tokens=sum(r.num_input_tokens + r.num_output_tokens for r in tree.records),
        rows=len(rows),
        leaves=len(leaves),
    )
