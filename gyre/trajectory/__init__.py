"""Request records, trajectory trees, provenance masks, admission sampling, materialisation, storage.

Flow: the proxy builds a :class:`RequestRecord` per model call, appends it to a
:class:`TrajectoryStore` and inserts it into the execution's :class:`TrajectoryTree`; at
admission :func:`sample_trajectories` picks up to ``J_max`` trajectories and
:func:`materialize` turns them into :class:`TrajectoryRow` s.

Modules: :mod:`~gyre.trajectory.records` (the record, roles, provenance);
:mod:`~gyre.trajectory.tree` (the tree), with :mod:`~gyre.trajectory.tree_nodes` (its nodes and
results), :mod:`~gyre.trajectory.tree_index` (where an input continues: anchors, longest match),
:mod:`~gyre.trajectory.tree_sharing` (nodes that keep views of a record's input) and
:mod:`~gyre.trajectory.tree_views` (stats, text and HTML views for inspection);
:mod:`~gyre.trajectory.store` (record files: writer, reader, store), with
:mod:`~gyre.trajectory.record_format` (the line format and its delta ring);
:mod:`~gyre.trajectory.admission` (trainable masks, sampling) and
:mod:`~gyre.trajectory.materialize` (rows for training).
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
