"""Boundary dispatch, counters, waterlevel policy; placements elastic / async / colocate.

The scheduler is a pure state machine (paper §4): build it from a
:class:`SchedulerConfig`, feed it events with :meth:`Scheduler.handle`, carry out the commands
it returns.  See :mod:`gyre.scheduler.events` for the protocol.

* :mod:`gyre.scheduler.scheduler` -- the state machine; :mod:`gyre.scheduler.config` -- its
  configuration;
* :mod:`gyre.scheduler.dispatch` -- boundary dispatch, execution counters, staleness (paper §4.1);
* :mod:`gyre.scheduler.placement` -- the ``elastic``, ``async`` and ``colocate`` placements (§4.2);
* :mod:`gyre.scheduler.routing` -- which execution is pinned to which engine.
"""

from .config import PLACEMENTS, SchedulerConfig
from .dispatch import BoundaryDispatch, Counters, ExecutionState
from .events import (STANDALONE, CellRoleChanged, CellState, CloseJoinWindow, Command, Dispatch,
                     EnqueueGroup, Event, ExecutionFinished, ExecutionLaunched, ExecutionStatus,
                     GroupReady, Launch, MicroStepDone, Publish, Reroute, Role, Start, SwitchFailed, Tick,
                     ToRollout, ToTrain, WeightsPublished)
from .placement import (AsyncPlacement, ColocatePlacement, ElasticPlacement, PlacementPolicy,
                        make_placement)
from .routing import RouteTable
from .scheduler import Scheduler

__all__ = [
    "PLACEMENTS", "SchedulerConfig", "Scheduler", "BoundaryDispatch", "Counters", "ExecutionState",
    "RouteTable", "PlacementPolicy", "ElasticPlacement", "AsyncPlacement", "ColocatePlacement",
    "make_placement", "STANDALONE", "Role", "CellState", "ExecutionStatus",
    # events
    "Event", "Start", "Tick", "ExecutionLaunched", "ExecutionFinished", "GroupReady", "MicroStepDone",
    "CellRoleChanged", "SwitchFailed", "WeightsPublished",
    # commands
    "Command", "Dispatch", "Launch", "Reroute", "ToTrain", "ToRollout", "EnqueueGroup",
    "CloseJoinWindow", "Publish",
]
