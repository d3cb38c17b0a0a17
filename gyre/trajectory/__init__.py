"""Request records, trajectory trees, provenance masks, admission sampling, materialisation, storage.

Flow: the proxy builds a :class:`RequestRecord` per model call, appends it to a
:class:`TrajectoryStore` and inserts it into the execution's :class:`TrajectoryTree`; at
admission :func:`sample_trajectories` picks up to ``J_max`` trajectories and
:func:`materialize` turns them into :class:`TrajectoryRow` s.

Modules: :mod:`gyre.trajectory.records` (one model call), :mod:`gyre.trajectory.tree` (the
prefix-sharing tree; its nodes view the records' arrays, :mod:`gyre.trajectory.tree_sharing`),
:mod:`gyre.trajectory.store` (append-only storage), :mod:`gyre.trajectory.admission` (trainable
tokens, ``J_max`` sampling), :mod:`gyre.trajectory.materialize` (training rows),
:mod:`gyre.trajectory.tree_views` (text and HTML views, ``tools/inspect_tree.py``).
"""

from gyre.trajectory.admission import (
    Admission,
    AdmissionConfig,
    AdmittedTrajectory,
    eligible_nodes,
    node_trainable_mask,
    sample_trajectories,
    trainable_counts,
)
from gyre.trajectory.materialize import DedupStats, TrajectoryRow, dedup_stats, materialize
from gyre.trajectory.records import DEFAULT_ROLE_PRIORITY, ROLES, Provenance, RequestRecord, Role
from gyre.trajectory.store import (
    RecordWriter,
    StoreCorruptError,
    TornTailWarning,
    TrajectoryStore,
    load_tree,
    read_records,
)
from gyre.trajectory.tree import ROOT, InsertResult, Node, PrefixMatch, RecordInfo, TrajectoryTree

__all__ = [
    "DEFAULT_ROLE_PRIORITY",
    "ROLES",
    "ROOT",
    "Admission",
    "AdmissionConfig",
    "AdmittedTrajectory",
    "DedupStats",
    "InsertResult",
    "Node",
    "PrefixMatch",
    "Provenance",
    "RecordInfo",
    "RecordWriter",
    "RequestRecord",
    "Role",
    "StoreCorruptError",
    "TornTailWarning",
    "TrajectoryRow",
    "TrajectoryStore",
    "TrajectoryTree",
    "dedup_stats",
    "eligible_nodes",
    "load_tree",
    "materialize",
    "node_trainable_mask",
    "read_records",
    "sample_trajectories",
    "trainable_counts",
]
