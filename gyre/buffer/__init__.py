"""Trajectory buffer (by rollout group) and stream packing buffer (micro-steps).

* :mod:`gyre.buffer.trajectory_buffer` -- rollout groups, reward validity, group readiness and
  advantages (:class:`TrajectoryBuffer`);
* :mod:`gyre.buffer.packing` -- admitted trajectory rows -> micro-steps under a token budget;
* :mod:`gyre.buffer.work_items` -- the unit a training cell claims from a step's micro-step stream.
"""

from gyre.buffer.trajectory_buffer import (
    BufferCounters,
    DropReason,
    GroupDropped,
    ReadyGroup,
    TrajectoryBuffer,
    materialize_group,
)

__all__ = ["BufferCounters", "DropReason", "GroupDropped", "ReadyGroup", "TrajectoryBuffer", "materialize_group"]
