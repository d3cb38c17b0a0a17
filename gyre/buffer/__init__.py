"""Trajectory buffer (by rollout group) and stream packing buffer (micro-steps)."""

from gyre.buffer.trajectory_buffer import (
    BufferCounters,
    DropReason,
    GroupDropped,
    ReadyGroup,
    TrajectoryBuffer,
    materialize_group,
)

__all__ = ["BufferCounters", "DropReason", "GroupDropped", "ReadyGroup", "TrajectoryBuffer", "materialize_group"]
