"""Admission: which tokens of a trajectory tree are trainable, and ``J_max`` sampling per execution.

:func:`node_trainable_mask` / :func:`trainable_counts` say which tokens may be training targets
(policy outputs of delivered records whose role is listed in the role priority, on the path of
an eligible leaf); :func:`sample_trajectories` admits up to ``J_max`` root-to-leaf trajectories
of one execution, highest-priority role first, each drawn with probability proportional to its
still-unclaimed trainable tokens, with disjoint target sets.  With ``j_max=None`` the union of
the admitted targets is exactly the trainable set.  Randomness comes from an injected
``numpy.random.Generator`` (one ``integers`` draw per admitted trajectory).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gyre.trajectory.records import DEFAULT_ROLE_PRIORITY, ROLES, Provenance, Role
from gyre.trajectory.tree import ROOT, TrajectoryTree

__all__ = [
    "AdmissionConfig",
    "AdmittedTrajectory",
    "Admission",
    "trainable_counts",
    "eligible_nodes",
    "node_trainable_mask",
    "sample_trajectories",
]


@dataclass(slots=True)
class AdmissionConfig:
    """Admission settings.

    * ``j_max`` -- cap on admitted trajectories per execution (default 5; ``None`` = no cap).
    * ``role_priority`` -- trainable roles, highest priority first (default
      ``main > subagent > compaction > auxiliary``); roles not listed are not trainable.
    * ``include_undelivered`` -- also train on outputs the harness never received.

    Raises:
        ValueError: ``j_max < 1``, unknown/duplicate roles, or ``evaluator`` listed.
    """

    j_max: int | None = 5
    role_priority: tuple[str, ...] = DEFAULT_ROLE_PRIORITY
    include_undelivered: bool = False

    def __post_init__(self) -> None:
        if self.j_max is not None and (int(self.j_max) != self.j_max or self.j_max < 1):
            raise ValueError(f"j_max must be a positive int or None, got {self.j_max!r}")
        roles = tuple(r.value if isinstance(r, Role) else r for r in self.role_priority)
        for r in roles:
            if r not in ROLES:
                raise ValueError(f"unknown role {r!r} in role_priority")
        if Role.EVALUATOR.value in roles:
            raise ValueError("evaluator outputs are never trainable; remove it from role_priority")
        if len(set(roles)) != len(roles):
            raise ValueError(f"duplicate roles in role_priority {roles}")
        self.role_priority = roles


@dataclass(slots=True)
class AdmittedTrajectory:
    """One admitted trajectory (a root-to-leaf path) and its targets.

    * ``leaf`` -- leaf node id; ``role`` -- its class (role of the leaf's record);
    * ``path`` -- node ids root-side first (root excluded);
    * ``target_nodes`` -- path nodes that were unmasked when drawn and hold trainable
      tokens; the targets are exactly the trainable tokens of these nodes;
    * ``num_targets`` -- number of targets (= the leaf's draw weight), ≥ 1.
    """

    leaf: int
    role: str
    path: tuple[int, ...]
    target_nodes: tuple[int, ...]
    num_targets: int


@dataclass(slots=True)
class Admission:
    """Result of :func:`sample_trajectories` for one execution.

    ``num_targets`` is ``L_i`` (targets over all admitted trajectories, deduplicated);
    ``trainable_tokens`` counts trainable tokens in the whole tree before sampling.
    """

    execution_id: str
    trajectories: list[AdmittedTrajectory]
    num_targets: int
    trainable_tokens: int
    config: AdmissionConfig


def _trainable_roles(config: AdmissionConfig) -> frozenset[str]:
    return frozenset(config.role_priority)


def eligible_nodes(tree: TrajectoryTree, config: AdmissionConfig | None = None) -> np.ndarray:
    """``bool[len(tree.nodes)]``: nodes on the path of at least one leaf whose role is in
    ``config.role_priority`` (only such paths can be admitted). Cost O(nodes)."""
    config = config or AdmissionConfig()
    roles = _trainable_roles(config)
    eligible = np.zeros(len(tree.nodes), bool)
    for nid, _ in reversed(list(tree.iter_preorder())):  # children before parents
        nd = tree.nodes[nid]
        if (not nd.children and tree.records[nd.record].role in roles) or eligible[nid]:
            eligible[nid] = True
            eligible[nd.parent] = True
    eligible[ROOT] = False
    return eligible


def node_trainable_mask(
    tree: TrajectoryTree,
    node_id: int,
    config: AdmissionConfig | None = None,
    eligible: np.ndarray | None = None,
) -> np.ndarray:
    """``bool[n]``: trainable tokens of node ``node_id``.

    A token is trainable iff

    * it is an **output** token of its node (it has a behaviour log-prob) with provenance
      ``POLICY`` -- input tokens are never targets, whatever their provenance, because the
      policy's log-prob for them in this context was never recorded;
    * the record that owns it has a role listed in ``role_priority`` (``evaluator`` can never
      be listed, so evaluator outputs and critiques are never trainable);
    * that record was delivered to the harness, unless ``include_undelivered`` is set;
    * it lies on the path of at least one leaf whose role is listed (only such paths can be
      admitted; e.g. with ``role_priority=("main",)`` a main output whose only continuation
      is a compaction call is not trainable).

    ``eligible`` (from :func:`eligible_nodes`) saves an O(nodes) pass when given.
    """
    config = config or AdmissionConfig()
    nd = tree.nodes[node_id]
    mask = np.zeros(nd.num_tokens, bool)
    if node_id == ROOT:
        return mask
    rec = tree.records[nd.record]
    if rec.role not in _trainable_roles(config) or not (rec.delivered or config.include_undelivered):
        return mask
    if eligible is None:
        eligible = eligible_nodes(tree, config)
    if not eligible[node_id]:
        return mask
    mask[nd.n_input:] = nd.provenance[nd.n_input:] == int(Provenance.POLICY)
    return mask


def trainable_counts(tree: TrajectoryTree, config: AdmissionConfig | None = None) -> np.ndarray:
    """``int64[len(tree.nodes)]``: trainable tokens per node id (root = 0). Cost O(nodes)."""
    config = config or AdmissionConfig()
    roles = _trainable_roles(config)
    policy = int(Provenance.POLICY)
    eligible = eligible_nodes(tree, config)
    counts = np.zeros(len(tree.nodes), np.int64)
    for nd in tree.nodes[1:]:
        rec = tree.records[nd.record]
        delivered = rec.delivered or config.include_undelivered
        if eligible[nd.node_id] and rec.role in roles and delivered and nd.num_output:
            counts[nd.node_id] = int(np.count_nonzero(nd.provenance[nd.n_input:] == policy))
    return counts


def sample_trajectories(
    tree: TrajectoryTree,
    rng: np.random.Generator,
    config: AdmissionConfig | None = None,
) -> Admission:
    """Admit up to ``config.j_max`` trajectories of one execution.

    Masking is per node: admitting a trajectory masks every node on its root-to-leaf path.
    Each round takes the highest-priority role class (a leaf's class is the role of the record
    that owns the leaf) that still has a leaf with unmasked trainable tokens, draws one of its
    leaves with probability proportional to that count (exact integer proportionality), fixes
    the trajectory's targets to the trainable tokens of the still-unmasked nodes on its path,
    and masks the path.  It stops when no unmasked trainable token is left on any eligible leaf
    or ``j_max`` trajectories are admitted.

    Args:
        tree: the execution's trajectory tree (not modified).
        rng: source of randomness (one ``integers`` draw per admitted trajectory).
        config: admission settings; default :class:`AdmissionConfig`.

    Returns:
        :class:`Admission` with trajectories in draw order and ``L_i``.

    Cost: O(nodes) per admitted trajectory.
    """
    config = config or AdmissionConfig()
    counts = trainable_counts(tree, config)
    nnodes = len(tree.nodes)
    parent = np.fromiter((nd.parent for nd in tree.nodes), np.int64, nnodes)
    # Parents before children (splits give heads larger ids than their children).
    order: list[int] = [nid for nid, _ in tree.iter_preorder()]
    leaves = tree.leaves()
    rank = {r: i for i, r in enumerate(config.role_priority)}
    leaves_by_class: list[list[int]] = [[] for _ in config.role_priority]
    for leaf in leaves:
        r = rank.get(tree.role(leaf))
        if r is not None:
            leaves_by_class[r].append(leaf)
    masked = np.zeros(nnodes, bool)
    admitted: list[AdmittedTrajectory] = []
    total = 0
    while config.j_max is None or len(admitted) < config.j_max:
        eff = np.where(masked, 0, counts)
        weight = np.zeros(nnodes, np.int64)
        for nid in order:
            weight[nid] = weight[parent[nid]] + eff[nid]
        chosen = -1
        for cls, cand in enumerate(leaves_by_class):
            if not cand:
                continue
            w = weight[cand]
            if w.max() <= 0:
                continue
            cum = np.cumsum(w)
            r = int(rng.integers(int(cum[-1])))
            chosen = cand[int(np.searchsorted(cum, r, side="right"))]
            role = config.role_priority[cls]
            break
        if chosen < 0:
            break
        path = tuple(tree.path(chosen))
        targets = tuple(n for n in path if not masked[n] and counts[n] > 0)
        n_t = int(weight[chosen])
        masked[list(path)] = True
        admitted.append(AdmittedTrajectory(chosen, role, path, targets, n_t))
        total += n_t
    return Admission(
        execution_id=tree.execution_id or "",
        trajectories=admitted,
        num_targets=total,
        trainable_tokens=int(counts.sum()),
        config=config,
    )
