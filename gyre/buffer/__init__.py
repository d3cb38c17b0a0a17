"""Trajectory buffer (by rollout group) and stream packing buffer (micro-steps).

* :mod:`gyre.buffer.trajectory_buffer` -- rollout groups, reward validity, group readiness and
  advantages (:class:`TrajectoryBuffer`);
* :mod:`gyre.buffer.packing` -- admitted trajectory rows -> micro-steps under a token budget
  (:class:`~gyre.buffer.packing.MicroStepPacker`), with :mod:`gyre.buffer.pack_units` (the rows
  and tries it places) and :mod:`gyre.buffer.micro_step` (:class:`~gyre.buffer.micro_step.MicroStep`,
  the packing settings and statistics);
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
